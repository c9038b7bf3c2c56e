"""Training objectives: per-token cross-entropy, loss weights (1/t, masked fraction) and normalisation.

Pure torch. The model predicts the clean token at the same position; the cross-entropy on masked
positions is weighted by 1/t. With ``normalize_by="all_tokens"`` the loss is a Monte-Carlo estimate of
the negative ELBO per token, an upper bound on the NLL.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

# How the cross-entropy of the scored tokens is weighted: per sequence (1/t, L/#masked, or 1), or per token by
# weights [b, s] the objective computed (`token_weights`; Dream's CART is one way of computing them, `cart_weights`)
Weighting = Literal["inverse_t", "masked_fraction", "none", "per_token"]


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [b, s] from logits [b, s, v] in float32."""
    b, s, v = logits.shape
    return F.cross_entropy(logits.float().reshape(b * s, v), targets.reshape(b * s), reduction="none").view(b, s)


def shift_targets(x0: torch.Tensor, masked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted prediction (difflm-shift): position i predicts x0[i+1], scored when x0[i+1] was masked."""
    targets = torch.roll(x0, -1, dims=1)
    scored = torch.roll(masked, -1, dims=1)
    scored[:, -1] = False  # the last position has no next token in the sequence
    return targets, scored


def loss_weights(
    t: torch.Tensor, masked: torch.Tensor, weighting: str, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-sequence weight [b]: 1/t, L/#masked (L: `lengths`, the valid tokens per row, default s), or 1 (none).

    `masked_fraction` is unbiased only with exact mask counts l ~ U{1..L} (LLaDA's discrete ELBO, Eq. 6 of its
    likelihood evaluation); the trainer masks exactly ceil(t L) tokens for it. Under Bernoulli(t) masking the
    count is uniform on {0..L} and the rows with none contribute 0: the loss would be L/(L+1) of the ELBO."""
    if weighting == "inverse_t":
        return 1.0 / t
    if weighting == "masked_fraction":
        length = lengths.to(t.dtype) if lengths is not None else masked.shape[1]
        return length / masked.sum(-1).clamp(min=1).to(t.dtype)
    if weighting == "none":
        return torch.ones_like(t)
    raise ValueError(f"weighting {weighting!r}: a per-sequence one of inverse_t, masked_fraction, none")


def cart_weights(masked: torch.Tensor, context: torch.Tensor, p: float = 0.3) -> torch.Tensor:
    """Dream's context-adaptive token-level reweighting (CART, hkunlp.github.io/blog/2025/dream): the weight
    [b, s] of masked token n is 0.5 * sum over clean context tokens i of p * (1 - p) ** (abs(n - i) - 1), a
    geometric decay in the distance to each clean token (an adjacent clean token adds 0.5 p); 0 where
    `masked` is False.

    `masked` [b, s]: the masked positions; `context` [b, s]: the clean tokens that count (the data tokens that
    are not masked). The weight replaces 1/t (Dream trains on it; it is not an ELBO). It follows the published
    formula and equals dllm's reference (`pipelines/dream/trainer.py::cart_weight`) to float rounding.

    The context is every clean token of the row: packed documents are not told apart, so under
    `model.document_attention` the clean tokens of a neighbouring document raise the weight of a masked token
    that cannot attend to them."""
    s = masked.shape[1]
    idx = torch.arange(s, device=masked.device)
    dist = (idx[None, :] - idx[:, None]).abs()  # [s, s]
    geo = 0.5 * p * (1 - p) ** (dist - 1).clamp(min=0).to(torch.float64)
    geo = geo.masked_fill(dist == 0, 0.0)  # a position is never its own context
    weights = (context & ~masked).to(torch.float64) @ geo  # geo is symmetric
    return (weights * masked).to(torch.float32)


def masked_diffusion_loss_terms(
    token_ce: torch.Tensor,
    masked: torch.Tensor,
    t: torch.Tensor,
    weighting: Weighting = "inverse_t",
    normalize_by: Literal["all_tokens", "masked_tokens"] = "all_tokens",
    valid: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of the loss over a micro-batch: the loss is sum / count over the GLOBAL batch.

    `weighting="per_token"` weighs each scored token by `token_weights` [b, s] (whatever computed them: CART's
    `cart_weights`, a new objective's own) instead of a per-sequence weight; weights given with another weighting
    are an error, not ignored.

    Returning the pair (as MegaDLMs' loss_func does) lets megatron divide by the global count, so every
    micro-batch / data-parallel split gives the same loss and gradient. `valid` [b, s] drops positions
    (the dataset's loss_mask) from both. token_ce [b, s] may hold anything at unscored positions."""
    if valid is not None:
        masked = masked & valid
    if weighting == "per_token":
        if token_weights is None:
            raise ValueError("weighting=per_token needs token_weights [b, s]: the weight of each scored token")
        w = token_weights
    elif token_weights is not None:
        raise ValueError(f"token_weights are read with weighting=per_token, not {weighting!r}: pass that")
    else:
        w = loss_weights(t, masked, weighting, None if valid is None else valid.sum(-1))[:, None]
    total = (token_ce * masked.to(token_ce.dtype) * w.to(token_ce.dtype)).sum()
    if normalize_by == "all_tokens":
        count = valid.sum() if valid is not None else torch.tensor(masked.numel(), device=masked.device)
    else:
        count = masked.sum()
    return total, count.to(torch.int)


def masked_diffusion_loss(
    token_ce: torch.Tensor,
    masked: torch.Tensor,
    t: torch.Tensor,
    weighting: Literal["inverse_t", "masked_fraction", "none"] = "inverse_t",
    normalize_by: Literal["all_tokens", "masked_tokens"] = "all_tokens",
) -> torch.Tensor:
    """Scalar loss of one batch from per-token cross-entropy [b, s] (any value at unscored positions)."""
    total, count = masked_diffusion_loss_terms(token_ce, masked, t, weighting, normalize_by)
    return total / count.clamp(min=1)


def x0_cross_entropy_terms(
    token_ce: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of plain cross-entropy over every (valid) position: the AR loss, and the uniform mode's
    `loss=x0_ce` option (UDLM's simple-CE ablation: a denoiser surrogate, not a bound)."""
    if valid is None:
        return token_ce.sum(), torch.tensor(token_ce.numel(), dtype=torch.int, device=token_ce.device)
    return (token_ce * valid.to(token_ce.dtype)).sum(), valid.sum().to(torch.int)
