"""What a contributor's new objective takes: a toy mode (masked diffusion weighted linearly in t instead of 1/t,
with a setting of its own) is one class registered in `MODES`. The forward step, the FLOPs count and the export
entry take it as they take the shipped modes, with no other production file changed."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch
from helpers import tiny_config

from models.diffusion import modes
from models.diffusion.modes import MaskedDiffusion, build_objective, objective_from_dict
from models.diffusion.objectives import masked_diffusion_loss_terms
from models.megatron.flops import training_flops
from models.megatron.forward_step import SpecialTokens, corrupt, loss_terms


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
        # "cart" is the formula's per-token weighting: here the linear weight of each row's t
        return masked_diffusion_loss_terms(output.float(), scored, t, "cart", "all_tokens", valid, weights)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(modes.MODES, LinearMaskedDiffusion.name, LinearMaskedDiffusion)
    return LinearMaskedDiffusion


def test_a_new_mode_trains_counts_and_exports_through_the_shared_code(toy, tmp_path):
    cfg = tiny_config(tmp_path)
    settings = types.SimpleNamespace(**{**cfg.diffusion.model_dump(), "model_running_mode": toy.name, "slope": 2.0})
    special = SpecialTokens(mask_id=1, vocab_size=50, special_ids=(0, 1, 2), eos_id=0, pad_id=2)
    objective = build_objective(settings, special.ids())
    assert isinstance(objective, toy) and objective.slope == 2.0 and objective.eps == cfg.diffusion.eps

    x0 = torch.randint(3, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": x0, "labels": x0, "positions": torch.arange(4)}
    prepared = corrupt(batch, cfg, special, step=3, objective=objective)
    ce = torch.ones_like(x0, dtype=torch.float)
    total, count = loss_terms(ce, prepared, cfg, special, objective=objective)
    expected = ((2.0 * (1 - prepared["t"]) + 1)[:, None] * prepared["scored"]).sum()
    assert torch.allclose(total, expected) and int(count) == x0.numel()

    base = training_flops(cfg, 50, [16], 4, objective=build_objective(cfg.diffusion))
    assert training_flops(cfg, 50, [16], 4, objective=objective) == base  # same network, same attention

    assert objective_from_dict(objective.to_dict(), special.ids()) == objective
