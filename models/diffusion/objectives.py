"""Training objectives: per-token cross-entropy, loss weights (1/t, masked fraction) and normalisation.

Pure torch. The model predicts the clean token at the same position; the cross-entropy on masked
positions is weighted by 1/t. With ``normalize_by="all_tokens"`` the loss is a Monte-Carlo estimate of
the negative ELBO per token, an upper bound on the NLL.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F


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
