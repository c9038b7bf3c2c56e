"""Diffusion samplers in pure torch: iterative unmasking (masked) and iterative denoising (uniform noise)."""

from __future__ import annotations

import torch

from .bounds import LogitsFn


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
    most confident ones, as many as the schedule allows. Returns [b, p + length].
    """
    b = prompt.shape[0]
    x = torch.cat([prompt, torch.full((b, length), mask_id, dtype=prompt.dtype)], dim=1)
    for n_reveal in unmask_schedule(length, steps):
        masked = x == mask_id  # [b, s]
        logits = logits_fn(x).float()  # [b, s, v]
        if vocab_limit is not None:
            logits = logits[..., :vocab_limit]
        logits[..., mask_id] = float("-inf")  # never predict the mask itself
        for tok in forbidden_ids:
            logits[..., tok] = float("-inf")
        probs = torch.softmax(logits / max(temperature, 1e-6), dim=-1) if temperature > 0 else None
        if probs is None:
            conf, pred = torch.softmax(logits, -1).max(-1)
        else:
            pred = torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=generator).view(b, -1)
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
    logits_fn: LogitsFn,
    prompt: torch.Tensor,
    length: int,
    steps: int,
    allowed_ids: torch.Tensor,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Generate `length` tokens after `prompt` [b, p] for a uniform-noise model: start from uniform
    tokens; at each step predict x0 and re-noise it to the next, lower noise level (t = 1 - k/steps),
    ending with the clean prediction. Returns [b, p + length]."""
    b, p = prompt.shape
    draw = lambda: allowed_ids[torch.randint(len(allowed_ids), (b, length), generator=generator)]  # noqa: E731
    x = torch.cat([prompt, draw().to(prompt.dtype)], dim=1)
    steps = max(1, steps)
    for k in range(1, steps + 1):
        logits = logits_fn(x)[:, p:].float()  # [b, length, v]
        restricted = torch.full_like(logits, float("-inf"))
        restricted[..., allowed_ids] = logits[..., allowed_ids]
        if temperature > 0:
            probs = torch.softmax(restricted / temperature, -1)
            pred = torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=generator).view(b, length)
        else:
            pred = restricted.argmax(-1)
        t_next = 1.0 - k / steps
        renoise = torch.rand((b, length), generator=generator) < t_next
        x[:, p:] = torch.where(renoise, draw().to(x.dtype), pred.to(x.dtype))
    return x
