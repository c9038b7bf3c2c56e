"""The model section and the architecture presets.

The section's architecture fields are not written here: they are the switches of `ModelArch`
(models/diffusion/arch.py, pure Python: no torch), each offered under its config name with its default, type,
help and bounds (`arch_fields`), as the `diffusion` section is built from the objectives' settings. A new switch
is a field of `ModelArch`, and the config has it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Literal

import pydantic
from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from difflm.config.base import OPERATIONAL, _Section
from difflm.errors import ConfigWarning
from difflm.models.diffusion.arch import ModelArch, config_name, paired_activation, switch_types

# (hidden >= GPU_WIDTH) give an FFN width that is a multiple of GEMM_TILE: 8/3*hidden rounded to 8 (5464 for the
# 1B) leaves partial GEMM tiles on every MLP matmul (+0.5-1 MFU point on a GPU).
GEMM_TILE = 128
GPU_WIDTH = 1024
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4},  # ~1M (+ embeddings)
    "small": {"num_layers": 6, "hidden_size": 256, "num_attention_heads": 4},  # ~5M
    # 70m and 250m: the ends of the literature's data-constrained studies (72M-257M with a 32k vocabulary)
    "70m": {"num_layers": 10, "hidden_size": 640, "num_attention_heads": 10, "ffn_hidden_size": 1792},
    "125m": {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12},
    "250m": {"num_layers": 17, "hidden_size": 1024, "num_attention_heads": 16, "ffn_hidden_size": 2816},
    "350m": {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "ffn_hidden_size": 2816},
    "1b": {
        "num_layers": 24,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_query_groups": 8,
        "ffn_hidden_size": 5632,
    },
    "3b": {
        "num_layers": 32,
        "hidden_size": 2560,
        "num_attention_heads": 32,
        "num_query_groups": 8,
        "ffn_hidden_size": 6912,
    },
    "7b": {
        "num_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_query_groups": 8,
        "ffn_hidden_size": 11008,
    },
}


class _ModelSection(_Section):
    """The model section but its architecture switches (ModelConfig adds them from ModelArch)."""

    preset: Literal["tiny", "small", "70m", "125m", "250m", "350m", "1b", "3b", "7b"] | None = Field(
        None, description="Architecture preset; fields given alongside override it."
    )
    backend: Literal["auto", "torch", "local", "te"] = Field(
        "auto",
        description="Layer spec. auto: 'te' on CUDA with Transformer Engine installed, else 'torch' (also on the "
        "CPU, where it gives the local spec's logits to ~1e-7 and trains faster). torch: megatron-core's layers with PyTorch scaled_dot_product_attention "
        "(flash/cuDNN kernels on GPUs; FlexAttention block masks for document_attention) and norms that support "
        "sequence parallelism. local: megatron-core's reference spec (unfused softmax). te: Transformer Engine "
        "(fused attention, fp8).",
    )
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = Field(
        "auto",
        json_schema_extra=OPERATIONAL,
        description="The torch backend's SDPA kernel. auto: PyTorch's choice (the trainer logs which); flash, "
        "cudnn, efficient (CUDA only) or math: forced around the forward and backward (an error if that kernel "
        "cannot take the inputs).",
    )
    fusions: Literal["auto", "off"] = Field(
        "auto",
        json_schema_extra=OPERATIONAL,
        description="auto: on CUDA, megatron's compiled SwiGLU (bias_activation_fusion), its native fused "
        "cross-entropy (bf16) and torch's fused AdamW; the CPU keeps the reference path. off: the reference path "
        "everywhere (the trainer logs the settings in use).",
    )
    recompute: Literal["off", "selective", "full"] = Field(
        "off",
        json_schema_extra=OPERATIONAL,
        description="Activation recompute (megatron's recompute_granularity): the backward recomputes what the "
        "forward did not keep, for larger micro-batches in the same memory (the same numbers, more time). "
        "selective: the core attention and the MLP of every layer; full: every layer from its input.",
    )
    compile: Literal["off", "rope", "layers"] = Field(
        "off",
        json_schema_extra=OPERATIONAL,
        description="torch.compile for the elementwise work, without Transformer Engine: rope compiles the rotary "
        "embedding; layers compiles every transformer layer whole (norms, residual adds, RoPE and activations "
        "fused). The same numbers up to the fused kernels' rounding; compiles cost seconds per process.",
    )
    cuda_graphs: Literal["off", "layers"] = Field(
        "off",
        json_schema_extra=OPERATIONAL,
        description="CUDA graphs (CUDA only): layers captures every transformer layer's forward and backward as "
        "graphs after a few warm-up steps (megatron's cuda_graph_impl=local), so a small model's step is not "
        "bound by launching kernels. The same numbers; static shapes (one micro-batch size and length per run).",
    )
    num_layers: int = Field(2, ge=1)
    hidden_size: int = Field(64, ge=8)
    num_attention_heads: int = Field(4, ge=1)
    num_query_groups: int | None = Field(None, ge=1, description="GQA groups (None: as many as heads).")
    ffn_hidden_size: int | None = Field(None, ge=1, description="None: 4*hidden (or 8/3*hidden with a gated MLP).")
    rotary_base: int = Field(10000, ge=1)
    tie_embeddings: bool = True
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    init_method_std: float = Field(0.02, gt=0.0)
    norm_epsilon: float = Field(1e-5, gt=0.0)
    hf_architecture: Literal["llama", "qwen2", "qwen3", "mistral", "gemma"] | None = Field(
        None,
        json_schema_extra=OPERATIONAL,
        description="The stock transformers class an `ar` export takes (recorded by `difflm convert HF_DIR`); "
        "None: the class whose switches the model has (models/hf/architectures.py; Llama by default). Exports only: "
        "training is the same.",
    )
    document_attention: bool = Field(
        False, description="Packed documents attend only within themselves (explicit mask on the local spec)."
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and "swiglu" in data:  # the old name, accepted for one release
            data = {k: v for k, v in data.items() if k != "swiglu"} | {"gated_mlp": data["swiglu"]}
        if isinstance(data, dict) and data.get("activation") == paired_activation(data.get("gated_mlp", True)):
            data = {**data, "activation": None}  # the default pairing, spelt out: the same run, the same name
        if isinstance(data, dict) and data.get("preset") in MODEL_PRESETS:
            return {**MODEL_PRESETS[data["preset"]], **data}
        return data

    @model_validator(mode="after")
    def _heads_divide(self) -> _ModelSection:
        if self.arch.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by num_query_groups ({groups})"
            )
        return self

    @field_validator("fusions", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _ffn_fills_gemm_tiles(self) -> _ModelSection:
        if self.hidden_size >= GPU_WIDTH and self.ffn_size % GEMM_TILE:
            warnings.warn(
                f"model.ffn_hidden_size={self.ffn_size} is not a multiple of {GEMM_TILE}: on GPUs every MLP matmul "
                f"leaves partial tiles; e.g. model.ffn_hidden_size={-(-self.ffn_size // GEMM_TILE) * GEMM_TILE}",
                ConfigWarning,
                stacklevel=2,
            )
        return self

    @property
    def arch(self) -> ModelArch:
        """The architecture switches as the record both implementations build from."""
        return ModelArch.of(self)

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.arch.gated_mlp:  # keeps the parameter count of a 4h GELU MLP, rounded to a multiple of 8
            return int(8 * self.hidden_size / 3 + 7) // 8 * 8
        return 4 * self.hidden_size


# what the config keeps of a switch's past: gated_mlp was model.swiglu, and the run-directory hash names it so
# (the old name is still read: `_apply_preset`), so runs named before the rename keep their names
_PAST: dict[str, dict[str, Any]] = {"gated_mlp": {"serialization_alias": "swiglu"}}


def arch_fields(record: type[ModelArch] = ModelArch) -> dict[str, tuple[Any, Any]]:
    """{config name: (type, Field)} of every switch of `record`: its default (the config's own where the switch
    says so, a None the config may leave unset), its type (a `Literal`'s choices), its help, its bounds and
    whether it names a run (IF_SET)."""
    types, fields = switch_types(record), {}
    for f in dataclasses.fields(record):
        meta = {k: v for k, v in f.metadata.items() if k not in ("config", "config_default", "identity")}
        default = f.metadata.get("config_default", f.default)
        kind = types[f.name] if default is not None else types[f.name] | None
        identity = f.metadata.get("identity")
        extra = None if identity is None else {"identity": identity}
        fields[config_name(f)] = (
            kind,
            Field(default, json_schema_extra=extra, **meta, **_PAST.get(config_name(f), {})),
        )
    return fields


if TYPE_CHECKING:  # the switches are read through `ModelConfig.arch` (the record) in type-checked code
    _WithSwitches = _ModelSection
else:
    _WithSwitches = pydantic.create_model("ModelSwitches", __base__=_ModelSection, **arch_fields())


# The `model` section: its presets, kernels and shape, then the architecture switches of `ModelArch`. (No
# docstring: the section's JSON schema, the Prefect form, has no description of its own.)
class ModelConfig(_WithSwitches):
    pass
