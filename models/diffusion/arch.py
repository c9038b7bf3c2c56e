"""The architecture record: the switches of the decoder that both implementations build (megatron-core's spec for
training, `modeling_difflm.py` in every export), in one small frozen value.

Pure Python, and copied into every export folder with the other modules of this package: the export writes the
record whole as the `architecture` entry of config.json and the shipped model reads it back with
`ModelArch.from_hf_config`, which also reads the flat fields of exports written before the record existed.
Norms after attention and MLP (Gemma 2 / 3 "post-norms") have no switch: megatron-core's layer has no slot for
them, so the importer refuses such sources instead.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

Activation = Literal["silu", "gelu", "gelu_tanh"]
Normalization = Literal["RMSNorm", "LayerNorm"]
ACTIVATIONS: tuple[str, ...] = typing.get_args(Activation)
IF_SET = "if_set"  # identity marking (difflm/config/base.py): joins the run's name only when set to another value
BOUNDS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}


def switch(
    default: Any,
    description: str | None,
    config: str | None = None,
    config_default: Any = dataclasses.MISSING,
    identity: str | None = None,
    **bounds: float,
) -> Any:
    """A field of the record, with what the config's `model` section offers it as (difflm/config/model.py builds
    the section's architecture fields from these, as its `diffusion` section from the objectives' settings):
    `description` (its help), `config` (its name there, where the config spells it otherwise), `config_default`
    (the config's default where it differs: None for a switch the config may leave unset, which `of` fills in),
    `identity` (IF_SET: it names a run only when set) and `bounds` (ge, gt, le, lt, checked here too). A `Literal`
    annotation gives its choices. So a new switch is one field here."""
    metadata: dict[str, Any] = {"description": description, **bounds}
    if config is not None:
        metadata["config"] = config
    if config_default is not dataclasses.MISSING:
        metadata["config_default"] = config_default
    if identity is not None:
        metadata["identity"] = identity
    return field(default=default, metadata=metadata)


def config_name(f: dataclasses.Field) -> str:
    """The name of a switch in the config's `model` section."""
    return f.metadata.get("config", f.name)


@dataclass(frozen=True)
class ModelArch:
    gated_mlp: bool = switch(True, "A gated MLP: act(gate) * up ([gate; up] rows). Was model.swiglu (still accepted).")
    activation: Activation = switch(
        "silu",
        "The MLP's activation; gelu_tanh: GELU's tanh approximation (Gemma). None: silu when gated (SwiGLU), else "
        "gelu.",
        config_default=None,  # the one paired with gated_mlp (`paired_activation`)
        identity=IF_SET,
    )
    normalization: Normalization = switch("RMSNorm", None)
    norm_offset: Literal[0, 1] = switch(
        0,
        "Norms scale by (norm_offset + w): 1 is Gemma's (1 + w) RMSNorm, weights stored zero-centred.",
        identity=IF_SET,
    )
    embedding_scale: bool = switch(False, "Token embeddings times sqrt(hidden_size) (Gemma).", identity=IF_SET)
    # a norm on every query and key head
    qk_norm: bool = switch(False, None, config="qk_layernorm")
    # biases on the fused Q/K/V projection; never on the others
    qkv_bias: bool = switch(False, "Biases on the Q, K and V projections (Qwen2); none elsewhere.", identity=IF_SET)
    head_dim: int | None = switch(
        None,
        "Width of one attention head (HF head_dim; Qwen3 sets it apart from hidden/heads). "
        "None: hidden_size / num_attention_heads.",
        config="kv_channels",
        identity=IF_SET,
        ge=1,
    )

    def __post_init__(self):
        types = switch_types(type(self))
        for f in dataclasses.fields(self):
            value, choices = getattr(self, f.name), typing.get_args(types[f.name])
            if typing.get_origin(types[f.name]) is Literal and value not in choices:
                raise ValueError(f"{f.name} {value!r}: one of {', '.join(map(str, choices))}")
            for bound, holds in BOUNDS.items():
                if bound in f.metadata and value is not None and not holds(value, f.metadata[bound]):
                    raise ValueError(f"{f.name} {value!r}: must be {bound} {f.metadata[bound]}")

    @classmethod
    def of(cls, model_cfg: Any) -> ModelArch:
        """The record of a `ModelConfig` (read by attribute: this module imports no config)."""
        values = {f.name: getattr(model_cfg, config_name(f)) for f in dataclasses.fields(cls)}
        if values["activation"] is None:
            values["activation"] = paired_activation(values["gated_mlp"])
        return cls(**values)

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        """The record of an export's config (a `DiffLMConfig` or its config.json as a dict): its `architecture`
        entry, else the flat fields that exports carried before it (silu or gelu, no offset, no scale)."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        record = get("architecture")
        if record:
            return cls(**record)
        return cls(
            gated_mlp=get("gated_mlp", True),
            activation="silu" if get("hidden_act", "silu") == "silu" else "gelu",
            normalization=get("normalization", "RMSNorm"),
            qk_norm=get("qk_layernorm", False),
            qkv_bias=get("qkv_bias", False),
            head_dim=get("head_dim"),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def model_fields(self) -> dict[str, Any]:
        """The record as `model.*` fields of this project's config (the inverse of `of`)."""
        fields = {config_name(f): getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.activation == paired_activation(self.gated_mlp):
            fields["activation"] = None  # the config's default for it
        return fields

    def head_width(self, hidden_size: int, heads: int) -> int:
        return self.head_dim or hidden_size // heads

    def embedding_multiplier(self, hidden_size: int) -> float | None:
        return math.sqrt(hidden_size) if self.embedding_scale else None

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one MLP: gate, up and down when gated, else up and down."""
        return 3 if self.gated_mlp else 2


def paired_activation(gated_mlp: bool) -> str:
    """The activation a config that leaves `model.activation` unset means: silu when gated (SwiGLU), else gelu."""
    return "silu" if gated_mlp else "gelu"


_TYPES: dict[type, dict[str, Any]] = {}  # switch_types of each record, resolved once


def switch_types(record: type = ModelArch) -> dict[str, Any]:
    """{switch: its type} of `record` (ModelArch, or a record extending it), the annotations resolved in this
    module's names (in an export folder too, where the module is loaded under another name)."""
    if record not in _TYPES:
        _TYPES[record] = typing.get_type_hints(record, globals())
    return _TYPES[record]
