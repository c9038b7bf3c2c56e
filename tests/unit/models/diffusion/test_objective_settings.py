"""Each objective carries its own family's settings, is built once from the config (`build_objective`) and is
written into an export as one entry read back by one function (`objective_from_dict`, old exports included)."""

from __future__ import annotations

import dataclasses
import types

import pytest
from helpers import tiny_config, tiny_hf_model

from difflm.config import DiffusionConfig, diffusion_model, load_config
from difflm.models.diffusion.modes import MODES, TOKEN_FIELDS, build_objective, objective_from_dict
from difflm.models.hf.configuration_difflm import DiffLMConfig
from difflm.models.hf.convert import hf_config
from difflm.models.hf.modeling_difflm import export_objective

TOKENS = {"mask_id": 1, "vocab_size": 64, "pad_id": 2, "eos_id": 0}

SETTINGS = {  # each family's own settings, nothing of the others'
    "difflm-noshift": ("sft_eos", "eps", "loss_weighting", "normalize_by"),
    "difflm-shift": ("sft_eos", "eps", "loss_weighting", "normalize_by", "cart_p"),
    "difflm-noshift-uniform": ("sft_eos", "eps", "uniform_loss"),
    "ar": ("sft_eos", "mir_mask_share", "mir_weight", "mir_share_draw"),
    "difflm-block": (
        "sft_eos",
        "eps",
        "loss_weighting",
        "normalize_by",
        "block_size",
        "clean_attention",
        "ar_loss_weight",
        "block_shift",
        "complementary_masks",
    ),
}


def test_each_objective_carries_only_its_familys_settings():
    assert {mode: cls.settings() for mode, cls in MODES.items()} == SETTINGS
    assert all(name in (f.name for f in dataclasses.fields(cls)) for cls in MODES.values() for name in TOKEN_FIELDS)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_configs_diffusion_section_has_every_setting_with_the_objectives_default(mode):
    """The config's section of a mode is the objective's settings (built from its fields, with their defaults)
    plus the shared ones: a run that leaves a setting out trains what the objective computes by default."""
    member = diffusion_model(mode)
    assert set(member.model_fields) == {*DiffusionConfig.model_fields, *SETTINGS[mode]}
    for f in dataclasses.fields(MODES[mode]):
        if f.name not in TOKEN_FIELDS:
            assert member.model_fields[f.name].default == f.default, (mode, f.name)


def test_build_objective_reads_the_modes_settings_from_the_config(tmp_path):
    cfg = tiny_config(
        tmp_path,
        "diffusion.model_running_mode=difflm-block",
        "diffusion.block_size=8",
        "diffusion.block_shift=true",
        "diffusion.eps=0.01",
    )
    obj = build_objective(cfg.diffusion, TOKENS)
    assert (obj.name, obj.block_size, obj.block_shift, obj.eps, obj.mask_id) == ("difflm-block", 8, True, 0.01, 1)
    assert obj.to_dict() == {"mode": "difflm-block", **{k: getattr(obj, k) for k in SETTINGS["difflm-block"]}}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_objective_round_trips_through_its_export_entry(mode):
    obj = MODES[mode](**TOKENS)
    assert objective_from_dict(obj.to_dict(), TOKENS) == obj
    # an entry from before a setting existed: that setting keeps its default; one this mode lacks is ignored
    assert objective_from_dict({"mode": mode, "no_such_setting": 3}, TOKENS) == obj


def test_the_time_conditioning_rule_is_one_method():
    for mode, cls in MODES.items():
        obj = cls(**TOKENS)
        assert obj.time_conditioned(True) == cls.uses_t and not obj.time_conditioned(False), mode


def test_an_export_records_its_objective_as_one_entry(tmp_path):
    cfg = load_config(
        "test-tiny",
        [f"workdir={tmp_path}", "diffusion.model_running_mode=difflm-block", "diffusion.block_size=8"],
    )
    config = hf_config(cfg, {"vocab_size": 64, "mask_id": 1, "eos_id": 0, "pad_id": 2})
    written = config.to_dict()
    assert written["objective"] == build_objective(cfg.diffusion).to_dict()
    assert not {"block_size", "clean_attention", "block_shift", "diffusion_eps"} & set(written)
    assert export_objective(DiffLMConfig.from_dict(written)) == build_objective(cfg.diffusion, TOKENS)


def test_an_export_written_before_the_entry_reads_its_own_fields():
    """Exports of before kept `diffusion_eps`, `block_size`, `clean_attention`, `block_shift` as fields (or none:
    eps was 1e-3 then)."""
    old = DiffLMConfig.from_dict(
        {
            "model_running_mode": "difflm-block",
            "block_size": 8,
            "clean_attention": "token_causal",
            "block_shift": True,
            "diffusion_eps": 0.02,
            "mask_token_id": 1,
            "vocab_size": 64,
            "eos_token_id": 0,
            "pad_token_id": 2,
        }
    )
    obj = export_objective(old)
    assert (obj.block_size, obj.clean_attention, obj.block_shift, obj.eps) == (8, "token_causal", True, 0.02)
    older = DiffLMConfig.from_dict(
        {"model_running_mode": "difflm-noshift-uniform", "mask_token_id": 1, "eos_token_id": 0, "pad_token_id": 2}
    )
    assert export_objective(older).eps == 1e-3


def test_the_loaded_model_builds_its_objective_once():
    model = tiny_hf_model("difflm-block", block_size=8)
    assert model.objective is model.objective and model.objective.block_size == 8
    model.config.objective = {"mode": "difflm-block", "block_size": 4}  # a replaced entry is read again
    assert model.objective.block_size == 4


def test_settings_are_fields_a_namespace_can_give():
    """`build_objective` reads attributes: any object with the mode and its settings will do (no pydantic)."""
    ns = types.SimpleNamespace(model_running_mode="difflm-shift", eps=0.1, loss_weighting="cart")
    ns.normalize_by, ns.cart_p, ns.sft_eos = "all_tokens", 0.5, "turn"
    obj = build_objective(ns)
    assert (obj.cart_p, obj.loss_weighting, obj.mask_id) == (0.5, "cart", None)
    with pytest.raises(ValueError, match="cart"):
        build_objective(types.SimpleNamespace(**{**vars(ns), "model_running_mode": "difflm-noshift"}))
