"""Likelihood bounds: the masked-diffusion ELBO (discrete form), the exact AR NLL, perplexity.

Pure torch; the functions take a `LogitsFn`, so training, evaluation and the exported HF model share them.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .noise import mask_exactly
from .objectives import token_cross_entropy

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # tokens [b, s] -> logits [b, s, v]


@torch.no_grad()
def elbo_nll_per_token(
    logits_fn: LogitsFn,
    x0: torch.Tensor,
    mask_id: int,
    t_samples: int,
    generator: torch.Generator | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Upper bound on the NLL per token (nats) of each sequence x0 [b, s]. [b]

    A Monte-Carlo estimate: pass a seeded `generator` for reproducible values. `valid` [b, s] (bool)
    restricts scoring to real tokens of padded rows; the bound is then per valid token.

    The masked-diffusion ELBO in its discrete form (LLaDA, eq. 6): with l ~ U{1..L} tokens masked at
    random, -log p(x0) <= E_l [ (L/l) * sum_{masked i} -log p(x0_i | x_t) ]. It equals the
    continuous-time bound E_t[(1/t) sum CE] but avoids the heavy 1/t tail at small t, so few samples
    suffice. l is stratified over `t_samples` equal bins of {1..L} per sequence.
    """
    b, s = x0.shape
    lengths = valid.sum(-1).clamp(min=1) if valid is not None else torch.full((b,), s)  # [b] L per row
    total = torch.zeros(b, dtype=torch.float64)
    for k in range(t_samples):
        u = torch.rand(b, generator=generator)
        counts = torch.minimum((((k + u) / t_samples) * lengths).ceil().clamp(min=1), lengths).long()
        xt, masked = mask_exactly(x0, counts, mask_id, generator, valid)
        ce = token_cross_entropy(logits_fn(xt), x0)
        total += ((ce * masked).sum(-1) * lengths / counts).double()
    return (total / t_samples / lengths).float()


def ar_nll_per_token(logits_fn: LogitsFn, x0: torch.Tensor) -> torch.Tensor:
    """Exact NLL per predicted token of a causal model on x0 [b, s]. [b]"""
    ce = token_cross_entropy(logits_fn(x0)[:, :-1], x0[:, 1:])
    return ce.mean(-1)


def perplexity(nll_per_token: float) -> float:
    return float(math.exp(min(nll_per_token, 700.0)))
