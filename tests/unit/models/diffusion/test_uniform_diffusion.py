"""Uniform-state diffusion maths, checked exactly on a model small enough to enumerate.

N = 3 states, L = 2 positions: 9 sequences. The reverse chain's exact marginal likelihood, the discrete
T-step ELBO (a sum of KLs) and the continuous-time ELBO of `difflm.models.diffusion.uniform` are all computed
by enumeration, with no Monte-Carlo noise, so the inequalities are tested exactly.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from difflm.models.diffusion import uniform as U

N, L, EPS = 3, 2, 1e-3
SEQS = torch.tensor(list(itertools.product(range(N), repeat=L)))  # [9, L] every sequence


class TinyDenoiser(torch.nn.Module):
    """x_theta(z_t, t): an MLP on the one-hot sequence and t; log-probabilities [b, L, N]."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(L * N + 1, 32), torch.nn.Tanh(), torch.nn.Linear(32, L * N))

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = torch.cat([torch.nn.functional.one_hot(z, N).flatten(1).float(), t[:, None].float()], -1)
        return torch.log_softmax(self.net(h).view(-1, L, N), -1)


def q_zt(x0: torch.Tensor, t: float) -> torch.Tensor:
    """q(z_t = each of the 9 sequences | x0 [L]). [9]"""
    alpha = 1 - t
    per_pos = torch.where(SEQS == x0, alpha + (1 - alpha) / N, (1 - alpha) / N)
    return per_pos.prod(-1).double()


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: one thread is faster (tests/conftest.py)


def continuous_elbo(model, x0: torch.Tensor, grid: int = 4000) -> float:
    """int_eps^1 E_{z_t} integrand dt (midpoint rule) + E_{z_eps} reconstruction, in nats per sequence."""
    ts = EPS + (1 - EPS) * (torch.arange(grid, dtype=torch.float64) + 0.5) / grid  # [G]
    z = SEQS.repeat(grid, 1)  # [G * 9, L]: every sequence at every grid point
    tt = ts.repeat_interleave(len(SEQS)).float()
    alpha = (1 - ts)[:, None, None]
    q = torch.where(SEQS[None] == x0, alpha + (1 - alpha) / N, (1 - alpha) / N).prod(-1).flatten()  # [G * 9]
    with torch.no_grad():
        f = U.nelbo_integrand(model(z, tt), x0.expand_as(z), z, tt).sum(-1)
        te = torch.full((len(SEQS),), EPS)
        rec = U.reconstruction_nll(model(SEQS, te), x0.expand_as(SEQS), SEQS, te).sum(-1)
    return float((q * f).sum()) * (1 - EPS) / grid + float((q_zt(x0, EPS) * rec).sum())


def _grid(steps: int) -> list[float]:
    return [EPS + (1 - EPS) * k / steps for k in range(steps + 1)]  # t_0 = eps ... t_T = 1


def reverse_step_matrix(model, t: float, s: float) -> torch.Tensor:
    """P[z_t, z_s] of the model's reverse step over the 9 sequences (s = 0: the reconstruction step)."""
    with torch.no_grad():
        log_p = model(SEQS, torch.full((len(SEQS),), t))
        post = U.posterior_log_probs(log_p, SEQS, t, s).exp().double()  # [9, L, N]
    return torch.stack([post[:, pos, SEQS[:, pos]] for pos in range(L)]).prod(0)  # [9 (z_t), 9 (z_s)]


def exact_nll(model, x0: torch.Tensor, steps: int) -> float:
    """-log p(x0) of the T-step reverse chain: z_1 uniform, posterior steps down to eps, then eps -> 0."""
    grid = _grid(steps)
    p = torch.full((len(SEQS),), 1.0 / len(SEQS), dtype=torch.float64)
    for k in range(steps, 0, -1):
        p = p @ reverse_step_matrix(model, grid[k], grid[k - 1])
    p = p @ reverse_step_matrix(model, EPS, 0.0)
    idx = int((SEQS == x0).all(-1).nonzero())
    return -math.log(float(p[idx]))


def discrete_elbo(model, x0: torch.Tensor, steps: int) -> float:
    """sum_k E_{z_t} KL(q(z_s | z_t, x0) || p(z_s | z_t)) + E_{z_eps} -log p(x0 | z_eps)."""
    one_hot = torch.log(torch.nn.functional.one_hot(x0, N).double().clamp(min=1e-300))[None].expand(len(SEQS), L, N)
    grid, total = _grid(steps), 0.0
    with torch.no_grad():
        for k in range(steps, 0, -1):
            t, s = grid[k], grid[k - 1]
            log_q = U.posterior_log_probs(one_hot.float(), SEQS, t, s).double()
            log_p = U.posterior_log_probs(model(SEQS, torch.full((len(SEQS),), t)), SEQS, t, s).double()
            kl = (log_q.exp() * (log_q - log_p)).nan_to_num(0.0).sum((-1, -2))  # [9]
            total += float((q_zt(x0, t) * kl).sum())
        rec = reverse_step_matrix(model, EPS, 0.0)[:, int((SEQS == x0).all(-1).nonzero())]
    return total - float((q_zt(x0, EPS) * rec.log()).sum())


@pytest.mark.parametrize("x0", [[0, 0], [2, 1]])
def test_continuous_elbo_is_the_limit_of_the_discrete_one_and_bounds_the_exact_nll(x0):
    model, x0 = TinyDenoiser(), torch.tensor(x0)
    cont = continuous_elbo(model, x0)
    d_coarse, d_fine = discrete_elbo(model, x0, 50), discrete_elbo(model, x0, 800)
    nll = exact_nll(model, x0, 800)
    assert d_fine >= nll - 1e-9  # the discrete ELBO bounds its own chain exactly
    assert abs(d_fine - cont) < 2e-3 * cont  # the closed form is the T -> infinity limit
    assert abs(d_coarse - cont) > abs(d_fine - cont)  # ... and the discrete sums converge to it
    assert cont >= nll  # and an upper bound on the (near-continuous) chain's NLL


def test_posterior_sampler_draws_from_the_reverse_chain():
    """Ancestral sampling with `posterior_log_probs` has the chain's exact marginal (checked on 9 outcomes)."""
    model, steps, n = TinyDenoiser(1), 8, 20_000
    g = torch.Generator().manual_seed(0)
    grid = _grid(steps)
    z = torch.randint(N, (n, L), generator=g)
    with torch.no_grad():
        for t, s in [*((grid[k], grid[k - 1]) for k in range(steps, 0, -1)), (EPS, 0.0)]:
            probs = U.posterior_log_probs(model(z, torch.full((n,), t)), z, t, s).exp()
            z = torch.multinomial(probs.view(-1, N), 1, generator=g).view(n, L)
    empirical = torch.stack([(z == seq).all(-1).double().mean() for seq in SEQS])
    exact = torch.tensor([math.exp(-exact_nll(model, seq, steps)) for seq in SEQS], dtype=torch.float64)
    assert abs(float(exact.sum()) - 1.0) < 1e-5  # a distribution (float32 steps)
    assert (empirical - exact).abs().max() < 0.015  # ~4 standard errors at n = 20k


def _data_batch(g: torch.Generator, b: int) -> torch.Tensor:
    """A toy data distribution: position 1 copies position 0 with probability 0.9."""
    first = torch.randint(N, (b,), generator=g)
    second = torch.where(torch.rand(b, generator=g) < 0.9, first, torch.randint(N, (b,), generator=g))
    return torch.stack([first, second], -1)


def test_training_on_the_uniform_elbo_tightens_the_bound_which_stays_above_the_nll():
    model, g = TinyDenoiser(2), torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x_eval = torch.tensor([1, 1])
    before = continuous_elbo(model, x_eval, grid=400)
    for _ in range(300):
        x0 = _data_batch(g, 64)
        t = EPS + (1 - EPS) * torch.rand(64, generator=g)
        keep = torch.rand(64, L, generator=g) >= t[:, None]
        xt = torch.where(keep, x0, torch.randint(N, (64, L), generator=g))
        loss = U.nelbo_integrand(model(xt, t), x0, xt, t).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = continuous_elbo(model, x_eval, grid=400)
    assert after < before - 0.5  # log p(1, 1) = log(0.9 * 1/3 + 0.1/9) ~ -1.17; untrained ~ log 9
    assert after >= exact_nll(model, x_eval, 400)
