"""Uniform-state diffusion (UDLM / DUO): the continuous-time ELBO, its reconstruction term, the posterior.

Pure torch. Forward process over N states (the vocabulary without mask/pad): q(z_t | x) = alpha_t e_x +
(1 - alpha_t) / N, with the linear schedule alpha_t = 1 - t, i.e. each token is replaced with probability t
by a uniform draw (which may redraw the same token). Notation of UDLM (Schiff et al. 2024, "Simple
Guidance Mechanisms for Discrete Diffusion Models", Sec. 3 and App. B), for one position with noisy token
i = z_t, clean one-hot x and prediction x_theta (a distribution over the states):

    a = N alpha_t x + (1 - alpha_t)        b = N alpha_t x_theta + (1 - alpha_t)           (vectors over states)
    NELBO = int_0^1 (-alpha'_t / alpha_t) E_{z_t} [ 1/b_i - 1/a_i + 1/(N a_i) sum_j a_j log(a_j b_i / (a_i b_j)) ] dt

It is the T -> infinity limit of the sum of KL(q(z_s | z_t, x) || q(z_s | z_t, x_theta)) over T steps
(`tests/unit/models/diffusion/test_uniform_diffusion.py` checks this against the discrete sum and against the exact NLL of the
reverse chain, computed by enumeration). Integrating from t = eps instead of 0 drops a positive term;
`reconstruction_nll` adds the exact last step eps -> 0, so `eps`-truncated estimates stay upper bounds.
"""

from __future__ import annotations

import math

import torch


def uniform_states(
    vocab_size: int, mask_id: int | None, pad_id: int | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The N states of uniform-noise diffusion: every token id the data can hold (EOS included, as a training
    target must be reachable), without the mask and pad tokens. Training and the export both call this."""
    keep = torch.ones(vocab_size, dtype=torch.bool, device=device)
    keep[[i for i in (mask_id, pad_id) if i is not None and i < vocab_size]] = False
    return keep.nonzero().squeeze(-1)


def state_log_probs(logits: torch.Tensor, states: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log x_theta over the N states from logits [..., V]: [..., N] (temperature 0 -> one-hot argmax)."""
    sub = logits[..., states].float()
    if temperature == 0:
        return torch.where(sub == sub.max(-1, keepdim=True).values, 0.0, float("-inf"))
    return torch.log_softmax(sub / temperature, dim=-1)


def state_index(tokens: torch.Tensor, states: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token ids -> their index among the states (-1 for a token that is not a state). Same shape."""
    lookup = torch.full((vocab_size,), -1, dtype=torch.long, device=tokens.device)
    lookup[states.to(tokens.device)] = torch.arange(len(states), device=tokens.device)
    return lookup[tokens]


def _log_b(log_p: torch.Tensor, alpha: torch.Tensor, n: int) -> torch.Tensor:
    """log(N alpha p + 1 - alpha), elementwise and stable, in log_p's dtype (the [b, s, N] tensor is the big
    one); alpha [b, s] broadcasts over the last axis."""
    a = alpha[..., None].to(log_p.dtype)
    return torch.logaddexp(log_p + torch.log(n * a), torch.log1p(-a))


def nelbo_integrand(log_p: torch.Tensor, x0: torch.Tensor, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The continuous-time NELBO integrand at noise level t, per position (nats). [b, s] float64

    log_p [b, s, N]: log x_theta over the states; x0, xt [b, s]: clean and noisy tokens as state indices;
    t [b] in (0, 1). The weight -alpha'/alpha = 1/(1 - t) of the linear schedule is included.
    """
    n = log_p.shape[-1]
    alpha = (1.0 - t.double()).clamp(min=1e-12)[:, None]  # [b, 1]
    a1, a0 = n * alpha + (1 - alpha), (1 - alpha)  # a_j for j = x0 and j != x0
    log_b = _log_b(log_p, alpha.expand_as(x0), n)  # [b, s, N]; per-position scalars below in float64
    log_b_i = log_b.gather(-1, xt[..., None]).squeeze(-1).double()
    log_b_x0 = log_b.gather(-1, x0[..., None]).squeeze(-1).double()
    same = xt == x0
    a_i = torch.where(same, a1, a0)
    # sum_j a_j log a_j   and   sum_j a_j log b_j, with a_j taking two values
    sum_a_log_a = a1 * torch.log(a1) + (n - 1) * a0 * torch.log(a0.clamp(min=1e-300))
    sum_a_log_b = a0 * log_b.sum(-1, dtype=torch.float64) + n * alpha * log_b_x0
    inner = sum_a_log_a - sum_a_log_b + n * (log_b_i - torch.log(a_i))
    bracket = torch.exp(-log_b_i) - 1.0 / a_i + inner / (n * a_i)
    return bracket / alpha


def reconstruction_nll(log_p: torch.Tensor, x0: torch.Tensor, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """-log p_theta(z_0 = x0 | z_t) of the last reverse step t -> 0, per position. [b, s] float64

    p_theta(z_0 = j | z_t = i) is proportional to (N alpha_t [j = i] + 1 - alpha_t) x_theta_j."""
    n = log_p.shape[-1]
    alpha = (1.0 - t.double())[:, None]
    log_b_i = _log_b(log_p, alpha.expand_as(x0), n).gather(-1, xt[..., None]).squeeze(-1).double()
    log_p_x0 = log_p.double().gather(-1, x0[..., None]).squeeze(-1)
    weight = torch.where(xt == x0, n * alpha + (1 - alpha), (1 - alpha).expand_as(x0))
    return -(torch.log(weight) + log_p_x0 - log_b_i)


def _f32(fn, x: float) -> float:
    """fn(x) evaluated in float32 on the CPU: the sampler's scalars as they always were, with no tensor
    left on a device other than the logits' (a CPU tensor expanded next to CUDA logits is an error)."""
    return fn(torch.tensor(x, dtype=torch.float32, device="cpu")).item()


def posterior_log_probs(log_p: torch.Tensor, xt: torch.Tensor, t: float, s: float) -> torch.Tensor:
    """log q(z_s | z_t, x_theta) over the states, for s < t (the ancestral step of the reverse chain). [..., N]

    Proportional to (N alpha_{t|s} e_{z_t} + 1 - alpha_{t|s}) * (N alpha_s x_theta + 1 - alpha_s)."""
    n = log_p.shape[-1]
    alpha_t, alpha_s = 1.0 - t, 1.0 - s
    a_ts = alpha_t / alpha_s
    log_keep = torch.full_like(log_p, _f32(torch.log1p, -a_ts) if a_ts < 1 else float("-inf"))
    log_keep.scatter_(-1, xt[..., None], _f32(torch.log, n * a_ts + 1 - a_ts))
    if alpha_s >= 1.0:  # s = 0: the clean token, x_theta itself times the transition
        log_prior = log_p.float()
    else:
        log_prior = torch.logaddexp(
            log_p.float() + _f32(torch.log, n * alpha_s),
            torch.full_like(log_p, _f32(torch.log1p, -alpha_s), dtype=torch.float32),
        )
    joint = log_keep + log_prior
    return joint - torch.logsumexp(joint, dim=-1, keepdim=True)


def mixture_t(v: torch.Tensor, eps: float) -> torch.Tensor:
    """Noise levels in [eps, 1] from uniforms v (stratified or not): half of [0, 1) maps to U(eps, 1), half
    to log-uniform on [eps, 1]. A replaced token at small t weighs ~1/t in the integrand (probability ~t):
    under U(eps, 1) such rare spikes dominate a batch (a fixed validation batch read 12 nats/token where the
    mean was 7). Drawing small t more often, with weight 1/p(t) (`mixture_weight`), keeps the estimate
    unbiased and bounded; the uniform half bounds the weight at large t (defensive importance sampling)."""
    w = 2.0 * v
    uniform_half = eps + (1.0 - eps) * w
    log_half = eps * torch.exp((w - 1.0) * math.log(1.0 / eps))
    return torch.where(v < 0.5, uniform_half, log_half).clamp(eps, 1.0)


def mixture_weight(t: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / p(t) for `mixture_t`'s density: integral_eps^1 g(t) dt = E[g(t) * mixture_weight(t)]."""
    density = 0.5 / (1.0 - eps) + 0.5 / (t.double() * math.log(1.0 / eps))
    return 1.0 / density
