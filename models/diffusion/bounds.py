"""Likelihood bounds: the masked-diffusion ELBO (discrete form), the uniform-diffusion ELBO, the exact AR NLL.

Pure torch; the functions take a `LogitsFn`, so training, evaluation and the exported HF model share them.
Every function scores the positions where `valid` is True and conditions on the others that are attended
(a clean prefix, e.g. the first token, so that AR and diffusion numbers cover the same tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .noise import NOISE_DEVICE, mask_exactly, uniform_corrupt
from .objectives import token_cross_entropy
from .uniform import mixture_t, mixture_weight, nelbo_integrand, reconstruction_nll, state_index, state_log_probs

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # tokens [b, s] -> logits [b, s, v]
TimedLogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens [b, s], t [b]) -> logits


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
    cpu = NOISE_DEVICE  # the draws and the per-row bookkeeping stay with the noise; x_t goes to the model
    lengths = valid.sum(-1).clamp(min=1).to(cpu) if valid is not None else torch.full((b,), s, device=cpu)  # [b] L
    total = torch.zeros(b, dtype=torch.float64, device=cpu)
    for k in range(t_samples):
        u = torch.rand(b, generator=generator, device=cpu)
        counts = torch.minimum((((k + u) / t_samples) * lengths).ceil().clamp(min=1), lengths).long()
        xt, masked = mask_exactly(x0, counts, mask_id, generator, valid)  # on x0's device
        ce = token_cross_entropy(logits_fn(xt), x0)
        total += ((ce * masked).sum(-1).to(cpu) * lengths / counts).double()
    return (total / t_samples / lengths).float()


@torch.no_grad()
def uniform_elbo_nll_per_token(
    logits_fn: TimedLogitsFn,
    x0: torch.Tensor,
    states: torch.Tensor,
    t_samples: int,
    eps: float = 1e-3,
    generator: torch.Generator | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Upper bound on the NLL per token (nats) of each x0 [b, s] under a uniform-noise model. [b]

    UDLM's continuous-time ELBO (see `uniform.py`), t stratified over `t_samples` bins of `mixture_t`'s
    importance distribution per sequence, plus the exact last step eps -> 0 (so the truncation at eps keeps
    it a bound). `states` are the token ids the noise draws from; positions outside `valid` stay clean and
    are not scored."""
    b, s = x0.shape
    valid = torch.ones_like(x0, dtype=torch.bool) if valid is None else valid.bool()
    lookup = max(int(states.max()), int(x0.max())) + 1  # noisy tokens are states or clean tokens
    x0_idx = state_index(x0, states, lookup)
    valid = valid & (x0_idx >= 0)
    x0_idx = x0_idx.clamp(min=0)

    def denoise(t: torch.Tensor):  # uniform draws at rate t on valid positions; (log x_theta, z_t) as states
        xt, _ = uniform_corrupt(x0, t, states, generator)  # drawn on the CPU, on x0's device
        xt = torch.where(valid, xt, x0)
        log_p = state_log_probs(logits_fn(xt, t.to(x0.device)), states.to(x0.device))
        return log_p, state_index(xt, states, lookup).clamp(min=0), t.to(x0.device)

    total = torch.zeros(b, dtype=torch.float64, device=x0.device)
    for k in range(t_samples):
        t = mixture_t((k + torch.rand(b, generator=generator, device=NOISE_DEVICE)) / t_samples, eps)  # [b], CPU
        log_p, xt_idx, t_dev = denoise(t)
        f = nelbo_integrand(log_p, x0_idx, xt_idx, t_dev)
        total += (f * valid).sum(-1) * mixture_weight(t, eps).to(f.device) / t_samples
    log_p, xt_idx, t_dev = denoise(torch.full((b,), eps, device=NOISE_DEVICE))  # the exact last step eps -> 0
    total += (reconstruction_nll(log_p, x0_idx, xt_idx, t_dev) * valid).sum(-1)
    return (total / valid.sum(-1).clamp(min=1)).float().cpu()


def ar_nll_per_token(logits_fn: LogitsFn, x0: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Exact NLL per scored token of a causal model on x0 [b, s]: tokens 1.. (token 0 has no context),
    only where `valid` when given. [b]"""
    ce = token_cross_entropy(logits_fn(x0)[:, :-1], x0[:, 1:])
    scored = torch.ones_like(ce, dtype=torch.bool) if valid is None else valid[:, 1:].bool()
    return ((ce * scored).sum(-1) / scored.sum(-1).clamp(min=1)).cpu()


def perplexity(nll_per_token: float) -> float:
    return float(math.exp(min(nll_per_token, 700.0)))
