"""Masked-diffusion mathematics in pure torch (no megatron, Prefect or MLflow imports).

Shared by training (megatron), evaluation and the exported Hugging Face model. Conventions follow
LLaDA / MegaDLMs' ``difflm-noshift``: a per-sequence noise level t ~ U(eps, 1); each token is replaced
by the mask id independently with probability t; the model predicts the clean token at the same
position; the cross-entropy on masked positions is weighted by 1/t. With ``normalize_by="all_tokens"``
the loss is a Monte-Carlo estimate of the negative ELBO per token, an upper bound on the NLL.
"""

from __future__ import annotations

import math
from typing import Callable, Literal

import torch
import torch.nn.functional as F

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # tokens [b, s] -> logits [b, s, v]


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
    return stratified_t(torch.rand(batch, generator=generator), torch.arange(batch), batch, eps, antithetic)


def mask_tokens(
    x0: torch.Tensor, t: torch.Tensor, mask_id: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt x0 [b, s] at rate t [b]: returns (x_t [b, s], masked [b, s] bool)."""
    u = torch.rand(x0.shape, generator=generator)
    masked = u < t[:, None].to(u.dtype)
    return torch.where(masked, torch.full_like(x0, mask_id), x0), masked


def uniform_corrupt(
    x0: torch.Tensor, t: torch.Tensor, allowed_ids: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform-noise corruption: with probability t a token is replaced by one drawn uniformly from
    `allowed_ids` (the non-special vocabulary; it may redraw the same token). (x_t, corrupted) [b, s]."""
    u = torch.rand(x0.shape, generator=generator)
    corrupted = u < t[:, None].to(u.dtype)
    draws = allowed_ids[torch.randint(len(allowed_ids), x0.shape, generator=generator)]
    return torch.where(corrupted, draws.to(x0.dtype), x0), corrupted


def shift_targets(x0: torch.Tensor, masked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted prediction (difflm-shift): position i predicts x0[i+1], scored when x0[i+1] was masked."""
    targets = torch.roll(x0, -1, dims=1)
    scored = torch.roll(masked, -1, dims=1)
    scored[:, -1] = False  # the last position has no next token in the sequence
    return targets, scored


def loss_weights(t: torch.Tensor, masked: torch.Tensor, weighting: str) -> torch.Tensor:
    """Per-sequence weight [b]: 1/t, 1/(empirical masked fraction), or 1."""
    if weighting == "inverse_t":
        return 1.0 / t
    if weighting == "masked_fraction":
        return masked.shape[1] / masked.sum(-1).clamp(min=1).to(t.dtype)
    return torch.ones_like(t)


def masked_diffusion_loss(
    token_ce: torch.Tensor,
    masked: torch.Tensor,
    t: torch.Tensor,
    weighting: Literal["inverse_t", "masked_fraction", "none"] = "inverse_t",
    normalize_by: Literal["all_tokens", "masked_tokens"] = "all_tokens",
) -> torch.Tensor:
    """Scalar loss from per-token cross-entropy [b, s] (any value at unscored positions)."""
    w = loss_weights(t, masked, weighting)[:, None]
    contrib = token_ce * masked.to(token_ce.dtype) * w.to(token_ce.dtype)  # [b, s]
    if normalize_by == "all_tokens":
        return contrib.sum() / masked.numel()
    return contrib.sum() / masked.sum().clamp(min=1)


def uniform_diffusion_loss(token_ce: torch.Tensor) -> torch.Tensor:
    """difflm-noshift-uniform: the model cannot tell which tokens were replaced, so every position is
    scored (x0-prediction cross-entropy averaged over all tokens)."""
    return token_ce.mean()


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [b, s] from logits [b, s, v] in float32."""
    b, s, v = logits.shape
    return F.cross_entropy(logits.float().reshape(b * s, v), targets.reshape(b * s), reduction="none").view(b, s)


def mask_exactly(x0: torch.Tensor, counts: torch.Tensor, mask_id: int, generator: torch.Generator | None = None,
                 valid: torch.Tensor | None = None):
    """Mask exactly counts[i] uniformly chosen positions of row i of x0 [b, s] (only among `valid`
    positions when given): (x_t, masked)."""
    u = torch.rand(x0.shape, generator=generator)
    if valid is not None:
        u = torch.where(valid, u, torch.full_like(u, 2.0))  # invalid positions sort last: never chosen
    ranks = u.argsort(dim=-1).argsort(dim=-1)  # a random permutation
    masked = ranks < counts[:, None]
    return torch.where(masked, torch.full_like(x0, mask_id), x0), masked


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


def document_ids(x0: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Index of the packed document each position belongs to (an EOS ends its own document). [b, s]"""
    is_eos = (x0 == eos_id).long()
    return is_eos.cumsum(-1) - is_eos


def document_attention_mask(doc_ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """[b, 1, s, s] bool, True where attention is BLOCKED (megatron's convention): across documents,
    and to the future when causal. Taken from the clean sequence, so a masked EOS still separates."""
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # [b, s(query), s(key)]
    if causal:
        s = doc_ids.shape[1]
        same = same & torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return ~same[:, None]


def perplexity(nll_per_token: float) -> float:
    return float(math.exp(min(nll_per_token, 700.0)))
