"""What a contributor's new objective takes: a toy mode (masked diffusion weighted linearly in t instead of 1/t,
with a setting of its own) is one class registered in `MODES`. The forward step, the FLOPs count and the export
entry take it as they take the shipped modes, with no other production file changed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import tiny_config

from difflm.config import ConfigError, PipelineConfig, load_config, with_mode
from difflm.models.diffusion import modes
from difflm.models.diffusion.modes import (
    IF_SET,
    BlockDiffusion,
    MaskedDiffusion,
    build_objective,
    objective_from_dict,
    setting,
)
from difflm.models.diffusion.objectives import masked_diffusion_loss_terms
from difflm.models.megatron.flops import training_flops
from difflm.models.megatron.forward_step import SpecialTokens, corrupt


@dataclass(frozen=True)
class LinearMaskedDiffusion(MaskedDiffusion):
    """Masked diffusion whose masked-token loss is weighted by `slope` * (1 - t) + 1, not 1/t (not a bound)."""

    slope: float = 1.0

    name = "toy-linear"

    def loss_terms(self, output, prepared, evaluation):
        if evaluation:
            return super().loss_terms(output, prepared, evaluation)
        weights = (self.slope * (1 - prepared["t"]) + 1)[:, None].expand_as(prepared["scored"])
        scored, t, valid = prepared["scored"], prepared["t"], prepared["valid"]
        # each token weighted by its own weight: here the linear weight of its row's t
        return masked_diffusion_loss_terms(output.float(), scored, t, "per_token", "all_tokens", valid, weights)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(modes.MODES, LinearMaskedDiffusion.name, LinearMaskedDiffusion)
    return LinearMaskedDiffusion


def test_a_new_mode_trains_counts_and_exports_through_the_shared_code(toy, tmp_path):
    cfg = tiny_config(tmp_path, "diffusion.model_running_mode=toy-linear", "diffusion.slope=2")
    special = SpecialTokens(mask_id=1, vocab_size=50, special_ids=(0, 1, 2), eos_id=0, pad_id=2)
    objective = build_objective(cfg.diffusion, special.ids())
    assert isinstance(objective, toy) and objective.slope == 2.0 and objective.eps == cfg.diffusion.eps

    x0 = torch.randint(3, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": x0, "labels": x0, "positions": torch.arange(4)}
    prepared = corrupt(batch, cfg, special, step=3, objective=objective)
    ce = torch.ones_like(x0, dtype=torch.float)
    total, count = objective.loss_terms(ce, prepared, False)
    expected = ((2.0 * (1 - prepared["t"]) + 1)[:, None] * prepared["scored"]).sum()
    assert torch.allclose(total, expected) and int(count) == x0.numel()

    base = training_flops(cfg, 50, [16], 4, objective=build_objective(with_mode(cfg, "difflm-noshift").diffusion))
    assert training_flops(cfg, 50, [16], 4, objective=objective) == base  # same network, same attention

    assert objective_from_dict(objective.to_dict(), special.ids()) == objective


def test_a_new_mode_is_a_config_section_of_its_own(toy):
    """Its settings are read from the dotlist like the shipped modes', validated, listed in the schema and in
    MLflow's params; another mode refuses them by name."""
    cfg = load_config("tiny-cpu", ["diffusion.model_running_mode=toy-linear", "diffusion.slope=2"])
    assert (cfg.diffusion.slope, cfg.diffusion.eps) == (2.0, 1e-3)
    assert isinstance(build_objective(cfg.diffusion), toy) and build_objective(cfg.diffusion).slope == 2.0
    assert cfg.flat()["diffusion.slope"] == 2.0
    assert "toy-linear" in PipelineConfig.model_json_schema()["$defs"]["DiffusionConfig"]["discriminator"]["mapping"]
    with pytest.raises(
        ConfigError, match="diffusion.slope is a setting of toy-linear; model_running_mode is difflm-noshift"
    ):
        load_config("tiny-cpu", ["diffusion.slope=3"])
    assert "slope" not in with_mode(cfg, "difflm-noshift").diffusion.model_dump()
    assert (
        load_config("tiny-cpu", ["diffusion.slope=1.0"]).diffusion.model_running_mode == "difflm-noshift"
    )  # its default


@dataclass(frozen=True)
class StridedBlockDiffusion(BlockDiffusion):
    """Block diffusion with one more setting, declared on the class only."""

    stride: int = setting(1, "A new block setting.", identity=IF_SET, ge=1)


def test_a_new_block_setting_is_declared_on_the_class_only(monkeypatch):
    before = load_config("tiny-cpu", ["diffusion.model_running_mode=difflm-block"]).stage_hash("diffusion")
    monkeypatch.setitem(modes.MODES, "difflm-block", StridedBlockDiffusion)
    cfg = load_config("tiny-cpu", ["diffusion.model_running_mode=difflm-block", "diffusion.stride=3"])
    assert build_objective(cfg.diffusion).stride == 3 and cfg.identity("diffusion")["stride"] == 3
    default = load_config("tiny-cpu", ["diffusion.model_running_mode=difflm-block"])
    assert default.stage_hash("diffusion") == before  # IF_SET: at its default, old runs keep their names
    with pytest.raises(ConfigError, match="diffusion.stride: Input should be greater than or equal to 1"):
        load_config("tiny-cpu", ["diffusion.model_running_mode=difflm-block", "diffusion.stride=0"])
    schema = PipelineConfig.model_json_schema()["$defs"]["DiffusionDifflmBlock"]["properties"]["stride"]
    assert schema["description"] == "A new block setting." and schema["identity"] == "if_set"
