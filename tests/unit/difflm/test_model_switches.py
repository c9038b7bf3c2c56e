"""The `model` section's architecture fields are generated from `ModelArch` (models/diffusion/arch.py): a switch is
written once, in the record, and the config offers it under its config name with its default, type, help, bounds
and identity."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import pydantic
import pytest

from difflm.config import ModelConfig, load_config
from difflm.config.base import _if_set, is_identity
from difflm.config.model import _ModelSection, arch_fields
from difflm.models.diffusion.arch import IF_SET, ModelArch, config_name, switch


def test_the_sections_architecture_fields_are_the_records_switches():
    generated = [n for n in ModelConfig.model_fields if n not in _ModelSection.model_fields]
    assert generated == [config_name(f) for f in dataclasses.fields(ModelArch)]
    assert "qk_layernorm" in generated and "kv_channels" in generated  # the config's own spellings
    for cfg in (
        load_config("test-tiny"),
        load_config("test-tiny", ["model.activation=gelu_tanh", "model.kv_channels=8"]),
    ):
        assert ModelArch.of(cfg.model).model_fields() == {n: getattr(cfg.model, n) for n in generated}
        assert cfg.model.arch == ModelArch.of(cfg.model)


@dataclass(frozen=True)
class WithWindow(ModelArch):
    """ModelArch with one more switch, as a contributor would add it (its type, default, help, bounds, identity)."""

    sliding_window: int | None = switch(None, "Attend to at most this many previous tokens.", identity=IF_SET, ge=1)
    rope_kind: Literal["plain", "yarn"] = switch("plain", "How positions rotate.", config="rotary_kind")


def test_a_new_switch_of_the_record_is_a_field_of_the_config():
    section = pydantic.create_model("WithWindowSection", __base__=_ModelSection, **arch_fields(WithWindow))
    fields = section.model_fields
    assert list(fields)[-2:] == ["sliding_window", "rotary_kind"]
    window = fields["sliding_window"]
    assert window.default is None and window.description == "Attend to at most this many previous tokens."
    assert is_identity(window) and _if_set(window)  # names a run only when set: old runs keep their names
    assert fields["rotary_kind"].default == "plain" and not _if_set(fields["rotary_kind"])

    model = section(sliding_window=64, rotary_kind="yarn")
    assert WithWindow.of(model) == WithWindow(head_dim=None, sliding_window=64, rope_kind="yarn")
    assert WithWindow.of(model).model_fields()["rotary_kind"] == "yarn"
    with pytest.raises(pydantic.ValidationError, match="greater than or equal to 1"):
        section(sliding_window=0)
    with pytest.raises(pydantic.ValidationError, match="'plain' or 'yarn'"):
        section(rotary_kind="ntk")
    # the record checks the same choices and bounds itself (an export's config.json is not read by the config)
    with pytest.raises(ValueError, match="sliding_window 0: must be ge 1"):
        WithWindow(sliding_window=0)
    with pytest.raises(ValueError, match="rope_kind 'ntk': one of plain, yarn"):
        WithWindow(rope_kind="ntk")


def test_a_switch_the_config_may_leave_unset_reads_as_the_records_value():
    """activation: None in the config (its default), the activation paired with gated_mlp in the record."""
    activation = ModelConfig.model_fields["activation"]
    assert activation.default is None and ModelArch().activation == "silu"
    assert load_config("test-tiny", ["model.gated_mlp=false"]).model.arch.activation == "gelu"
    assert ModelConfig.model_fields["gated_mlp"].serialization_alias == "swiglu"  # its name in old run hashes
