"""The `diffusion` section: a union keyed by the mode whose members are the objective classes' settings."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import TYPE_CHECKING, Annotated, Any, Literal

import pydantic
from pydantic import (
    Field,
    TypeAdapter,
    model_validator,
)

from difflm.config.base import IF_SET, _Section

if TYPE_CHECKING:
    from difflm.config.pipeline import PipelineConfig
    from difflm.models.diffusion.modes import Objective


def modes():
    """difflm.models.diffusion.modes, imported when a config is first validated: it imports torch, which `difflm --help`
    (it loads this package) should not wait for."""
    from difflm.models.diffusion import modes as module

    return module


DEFAULT_MODE = "difflm-noshift"

# The identity of before the per-mode sections: every mode's run name held these settings of the flat section (at
# their defaults where the mode lacks them). Frozen, so those runs keep their directories; a setting added later
# is IF_SET or belongs to its mode alone.
FLAT_IDENTITY_DEFAULTS = {
    "eps": 1e-3,
    "loss_weighting": "inverse_t",
    "uniform_loss": "elbo",
    "normalize_by": "all_tokens",
}


class DiffusionConfig(_Section):
    """The settings every mode shares. The section a config holds is the member of its mode (`diffusion_model`):
    these plus the objective's own settings, declared once on its class in models/diffusion/modes.py."""

    model_running_mode: str = Field(
        DEFAULT_MODE,
        description="The objective, one of models/diffusion/modes.py's MODES: difflm-noshift (masked diffusion, "
        "LLaDA/MDLM), difflm-noshift-uniform (uniform-state, UDLM/DUO), difflm-shift (shifted masked diffusion to "
        "adapt AR checkpoints, DiffuLLaMA/Dream), ar (the causal baseline), difflm-block (block diffusion, BD3-LM).",
    )
    attention_anneal_steps: int = Field(
        0,
        ge=0,
        json_schema_extra=IF_SET,
        description="DiffuLLaMA's attention-mask annealing (arXiv 2410.17891): over the first N training steps "
        "attention goes from causal to full, a query seeing a later key with probability step / N (one "
        "Bernoulli mask per step, shared by the batch): step 0 is exactly causal, steps >= N exactly full. "
        "Validation uses full attention (the adapted model's). 0: off. Bidirectional modes only.",
    )
    antithetic_t: bool = Field(False, description="Stratify t across the global batch (lower-variance loss).")
    varilen_prob: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="difflm_varilen_prob: chance that a micro-batch trains on a random "
        "shorter length in [2, seq_length] (diffusion modes only; MegaDLMs' default is 0.01).",
    )
    time_embedding: bool = Field(False, description="difflm_time_embedding: condition the network on t.")
    time_conditioning: Literal["adaln", "input"] = Field(
        "adaln",
        description="How t enters when time_embedding is on. adaln: every layer norm is modulated by "
        "t (DiT-style, as UDLM/DUO; needs model.backend=torch or local: Transformer Engine fuses the norms into its layers); input: an MLP of t added to the token "
        "embeddings (the first layer only; any backend).",
    )

    @model_validator(mode="after")
    def _objective_checks(self) -> DiffusionConfig:
        if type(self) is not DiffusionConfig:  # a member: the objective's own checks of its settings
            modes().build_objective(self)
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        if cls is not DiffusionConfig:
            return handler(core_schema)
        # the section as the form shows it: one member per mode, chosen by model_running_mode
        members = tuple(diffusion_model(mode) for mode in modes().MODES)
        union = Annotated[typing.Union[members], Field(discriminator="model_running_mode")]  # noqa: UP007
        return handler(TypeAdapter(union).core_schema)


_MEMBERS: dict[type[Objective], type[DiffusionConfig]] = {}


def diffusion_model(mode: str) -> type[DiffusionConfig]:
    """The `diffusion` section of `mode`: the shared settings plus the objective class's own, built from its
    dataclass fields (default, `Literal` choices, and the metadata of `modes.setting`). Built on first use, so a
    mode registered in MODES later has its section too."""
    cls = modes().objective_class(mode)
    member = _MEMBERS.get(cls)
    if member is None:
        hints = typing.get_type_hints(cls)
        own: dict[str, Any] = {
            f.name: (hints[f.name], _setting_field(f)) for f in dataclasses.fields(cls) if f.name in cls.settings()
        }
        doc = (cls.__doc__ or "").split("\n\n")[0]
        fields: dict[str, Any] = {"model_running_mode": (Literal[mode], Field(mode, description=" ".join(doc.split())))}
        name = "Diffusion" + "".join(part.title() for part in re.split(r"[^A-Za-z0-9]+", mode))
        member = pydantic.create_model(name, __base__=DiffusionConfig, **{**fields, **own})
        _MEMBERS[cls] = member
    return member


def _setting_field(f: dataclasses.Field) -> Any:
    meta = dict(f.metadata)
    identity = meta.pop("identity", None)
    extra = None if identity is None else {"identity": identity}
    if f.default_factory is not dataclasses.MISSING:
        return Field(default_factory=f.default_factory, json_schema_extra=extra, **meta)
    return Field(f.default, json_schema_extra=extra, **meta)


def diffusion_section(value: Any) -> Any:
    """A `diffusion` mapping as its mode's member. A setting of another mode is dropped at that mode's default (a
    run's config.yaml of before the per-mode sections holds every setting) and refused otherwise."""
    if type(value) is DiffusionConfig:  # the shared settings alone: the member of their mode
        value = value.model_dump()
    if not isinstance(value, dict):
        return value
    data = dict(value)
    mode = data.setdefault("model_running_mode", DEFAULT_MODE)
    known = modes().MODES
    if mode not in known:
        raise ValueError(f"diffusion.model_running_mode {mode!r} is not a mode: one of {', '.join(map(repr, known))}")
    member = diffusion_model(mode)
    for name in [n for n in data if n not in member.model_fields]:
        having = {m: c for m, c in modes().MODES.items() if name in c.settings()}
        if not having:
            continue  # unknown everywhere: extra="forbid" names it, with a close match
        if any(data[name] == _default(c, name) for c in having.values()):
            del data[name]
            continue
        raise ValueError(
            f"diffusion.{name} is a setting of {', '.join(having)}; model_running_mode is {mode} "
            f"(switch the mode, or leave {name} out)"
        )
    return member.model_validate(data)


def _default(cls: type[Objective], name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def with_mode(cfg: PipelineConfig, mode: str, **settings: Any) -> PipelineConfig:
    """`cfg` training `mode`: the shared settings kept, the settings of the old mode that the new one lacks dropped,
    `settings` set."""
    member = diffusion_model(mode)
    data = {**cfg.diffusion.model_dump(), **settings, "model_running_mode": mode}
    diffusion = member.model_validate({k: v for k, v in data.items() if k in member.model_fields})
    return cfg.model_copy(update={"diffusion": diffusion})
