"""Diffusion samplers in pure torch: iterative unmasking (masked) and iterative denoising (uniform noise)."""

from __future__ import annotations

import torch

from .bounds import LogitsFn, TimedLogitsFn
from .uniform import posterior_log_probs, state_log_probs


def unmask_schedule(length: int, steps: int) -> list[int]:
    """How many tokens to reveal at each of `steps` steps, summing to `length` (front-loaded remainder)."""
    steps = max(1, min(steps, length))
    base, rem = divmod(length, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


@torch.no_grad()
def sample_masked_diffusion(
    logits_fn: LogitsFn,
    prompt: torch.Tensor,
    length: int,
    mask_id: int,
    steps: int,
    vocab_limit: int | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    forbidden_ids: tuple[int, ...] = (),
) -> torch.Tensor:
    """Generate `length` tokens after `prompt` [b, p] by low-confidence remasking (LLaDA's sampler).

    Start with every new position masked; at each step predict all masked positions and commit the
    most confident ones, as many as the schedule allows. Confidence is the untempered probability of the
    chosen token (as LLaDA), whatever the sampling temperature. Returns [b, p + length].
    """
    b = prompt.shape[0]
    x = torch.cat([prompt, torch.full((b, length), mask_id, dtype=prompt.dtype, device=prompt.device)], dim=1)
    for n_reveal in unmask_schedule(length, steps):
        masked = x == mask_id  # [b, s]
        logits = logits_fn(x).float()  # [b, s, v]
        if vocab_limit is not None:
            logits = logits[..., :vocab_limit]
        logits[..., mask_id] = float("-inf")  # never predict the mask itself
        for tok in forbidden_ids:
            logits[..., tok] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        if temperature > 0:
            tempered = torch.softmax(logits / temperature, dim=-1).view(-1, logits.shape[-1])
            pred = torch.multinomial(tempered.cpu(), 1, generator=generator).view(b, -1).to(x.device)
        else:
            pred = probs.argmax(-1)
        conf = probs.gather(-1, pred[..., None]).squeeze(-1)
        conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
        for i in range(b):
            k = min(n_reveal, int(masked[i].sum()))
            if k:
                idx = conf[i].topk(k).indices
                x[i, idx] = pred[i, idx]
    return x


@torch.no_grad()
def sample_uniform_diffusion(
    logits_fn: TimedLogitsFn,
    prompt: torch.Tensor,
    length: int,
    steps: int,
    states: torch.Tensor,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Generate `length` tokens after `prompt` [b, p] with a uniform-noise model: the ancestral sampler of
    the reverse chain whose ELBO the model was trained on (UDLM / DUO). Start from uniform draws over the
    `states` at t = 1; at each of `steps` steps t -> s = t - 1/steps draw z_s ~ q(z_s | z_t, x_theta(z_t, t))
    (which keeps z_t with raised probability), the last step landing on clean tokens at s = 0.
    `temperature` sharpens x_theta (0: its argmax). Returns [b, p + length]."""
    b, p = prompt.shape
    states = states.to(prompt.device)
    z = torch.randint(len(states), (b, length), generator=generator).to(prompt.device)  # state indices
    steps = max(1, steps)
    for k in range(steps, 0, -1):
        t, s = k / steps, (k - 1) / steps
        x = torch.cat([prompt, states[z].to(prompt.dtype)], dim=1)
        logits = logits_fn(x, torch.full((b,), t, device=prompt.device))[:, p:]
        log_p = state_log_probs(logits, states, temperature)
        post = posterior_log_probs(log_p, z, t, s).exp().view(-1, len(states))
        z = torch.multinomial(post.cpu(), 1, generator=generator).view(b, length).to(prompt.device)
    return torch.cat([prompt, states[z].to(prompt.dtype)], dim=1)
