"""Noise levels and corruption: t per sequence, masking (random or exact counts), uniform replacement.

Pure torch. Conventions follow LLaDA / MegaDLMs' ``difflm-noshift``: a per-sequence noise level
t ~ U(eps, 1); each token is replaced by the mask id independently with probability t.
"""

from __future__ import annotations

import torch

# Noise is drawn on the CPU, from CPU generators, whatever device the model is on: a CUDA generator gives
# another stream, so a seeded bound or sample would change with the device. Draws then move to the data.
NOISE_DEVICE = torch.device("cpu")


def stratified_t(u: torch.Tensor, index: torch.Tensor, n: int, eps: float, antithetic: bool) -> torch.Tensor:
    """Noise levels in [eps, 1] from uniforms u [b]; antithetic: sequence `index` of n uses bin index/n.

    Stratifying covers the range evenly and lowers the variance of the batch loss without biasing it;
    taking the bin from the sequence's position in the *global* batch keeps t independent of how the
    batch is split across micro-batches and data-parallel ranks.
    """
    v = (index.to(u.dtype) + u) / n if antithetic else u
    return eps + (1.0 - eps) * v


def sample_t(
    batch: int, eps: float, generator: torch.Generator | None = None, antithetic: bool = False
) -> torch.Tensor:
    """Noise levels t in [eps, 1], one per sequence. [b]"""
    u = torch.rand(batch, generator=generator, device=NOISE_DEVICE)
    return stratified_t(u, torch.arange(batch, device=NOISE_DEVICE), batch, eps, antithetic)


def mask_tokens(
    x0: torch.Tensor, t: torch.Tensor, mask_id: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt x0 [b, s] at rate t [b]: returns (x_t [b, s], masked [b, s] bool) on x0's device."""
    u = torch.rand(x0.shape, generator=generator, device=NOISE_DEVICE)
    masked = (u < t[:, None].to(NOISE_DEVICE, u.dtype)).to(x0.device)
    return torch.where(masked, torch.full_like(x0, mask_id), x0), masked


def mask_exactly(
    x0: torch.Tensor,
    counts: torch.Tensor,
    mask_id: int,
    generator: torch.Generator | None = None,
    valid: torch.Tensor | None = None,
):
    """Mask exactly counts[i] uniformly chosen positions of row i of x0 [b, s] (only among `valid`
    positions when given): (x_t, masked) on x0's device. The ranking stays with the draws, on the CPU: a
    tie between two draws then breaks the same way whatever the device."""
    u = torch.rand(x0.shape, generator=generator, device=NOISE_DEVICE)
    if valid is not None:  # invalid positions sort last: never chosen
        u = torch.where(valid.to(NOISE_DEVICE), u, torch.full_like(u, 2.0))
    ranks = u.argsort(dim=-1).argsort(dim=-1)  # a random permutation
    masked = (ranks < counts.to(NOISE_DEVICE)[:, None]).to(x0.device)
    return torch.where(masked, torch.full_like(x0, mask_id), x0), masked


def uniform_corrupt(
    x0: torch.Tensor, t: torch.Tensor, states: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform-noise corruption: with probability t a token is replaced by one drawn uniformly from the
    `states` (the vocabulary without mask and pad; it may redraw the same token). (x_t, corrupted) [b, s] on
    x0's device."""
    u = torch.rand(x0.shape, generator=generator, device=NOISE_DEVICE)
    corrupted = (u < t[:, None].to(NOISE_DEVICE, u.dtype)).to(x0.device)
    pick = torch.randint(len(states), x0.shape, generator=generator, device=NOISE_DEVICE)
    draws = states.to(x0.device)[pick.to(x0.device)]
    return torch.where(corrupted, draws.to(x0.dtype), x0), corrupted
