"""The per-micro-batch forward step and loss of every training mode, on a megatron model.

The corruption and the loss formulas are in `models.diffusion` (pure torch); this module only wires
them to megatron: the noise generator seeded by (seed, step, micro-batch, data-parallel rank) so that
tensor- and pipeline-parallel peers draw the same noise and a resumed run redraws it, and the
per-token cross-entropy computed by megatron's (vocab-parallel) loss.
"""

from __future__ import annotations

from functools import partial

import torch

from difflm.config import PipelineConfig
from models import diffusion


def noise_generator(seed: int, step: int, micro: int, dp_rank: int) -> torch.Generator:
    g = torch.Generator()
    # Distinct streams per (seed, step, micro, dp_rank); a large odd multiplier avoids collisions.
    g.manual_seed((seed * 1_000_003 + step * 10_007 + micro * 101 + dp_rank) % (2**63 - 1))
    return g


def corrupt(batch: dict, cfg: PipelineConfig, mask_id: int, gen: torch.Generator) -> dict:
    """Model inputs and loss targets for one micro-batch of `cfg`'s objective."""
    x0 = batch["tokens"]
    d = cfg.diffusion
    if d.model_running_mode == "ar":
        return {"inputs": x0, "targets": batch["labels"], "masked": torch.ones_like(x0, dtype=torch.bool), "t": None}
    t = diffusion.sample_t(x0.shape[0], d.eps, gen, antithetic=d.antithetic_t)
    xt, masked = diffusion.mask_tokens(x0, t, mask_id, gen)
    return {"inputs": xt, "targets": x0, "masked": masked, "t": t}


def loss_from_token_ce(token_ce: torch.Tensor, prepared: dict, cfg: PipelineConfig) -> torch.Tensor:
    d = cfg.diffusion
    if d.model_running_mode == "ar":
        return token_ce.float().mean()
    return diffusion.masked_diffusion_loss(
        token_ce.float(), prepared["masked"], prepared["t"], d.loss_weighting, d.normalize_by
    )


def _loss_func(prepared: dict, cfg: PipelineConfig, output_tensor: torch.Tensor):
    loss = loss_from_token_ce(output_tensor, prepared, cfg)
    return loss, {"loss": loss.detach().clone()}


def make_forward_step(cfg: PipelineConfig, mask_id: int, step: int, dp_rank: int):
    """A megatron `forward_step_func(data_iterator, model)` for training step `step`."""
    micro_counter = iter(range(10**9))

    def forward_step(data_iterator, model):
        micro = next(micro_counter)
        batch = next(data_iterator)
        prepared = corrupt(batch, cfg, mask_id, noise_generator(cfg.train.seed, step, micro, dp_rank))
        inputs = prepared["inputs"]
        position_ids = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
        # With labels, megatron returns the per-token (vocab-parallel) cross-entropy [b, s].
        token_ce = model(inputs, position_ids, None, labels=prepared["targets"])
        return token_ce, partial(_loss_func, prepared, cfg)

    return forward_step
