"""Diffusion samplers in pure torch: iterative unmasking (masked) and iterative denoising (uniform noise)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .bounds import LogitsFn, TimedLogitsFn
from .noise import NOISE_DEVICE
from .uniform import posterior_log_probs, state_log_probs

# One generator for the batch, or one per row: per-row generators make a row's sample independent of the rows
# batched with it (the scorer seeds each by its prompt). Draws are made on the CPU either way.
Generators = torch.Generator | Sequence[torch.Generator | None] | None


def draw_multinomial(probs: torch.Tensor, generator: Generators) -> torch.Tensor:
    """One token per position from probs [b, ..., V]: [b, ...] on probs' device."""
    b, v = probs.shape[0], probs.shape[-1]
    flat = probs.to(NOISE_DEVICE).reshape(b, -1, v)
    if isinstance(generator, (list, tuple)):
        out = torch.stack([torch.multinomial(flat[i], 1, generator=g)[:, 0] for i, g in enumerate(generator)])
    else:
        out = torch.multinomial(flat.reshape(-1, v), 1, generator=_one(generator)).view(b, -1)
    return out.view(probs.shape[:-1]).to(probs.device)


def draw_rand(shape: tuple[int, ...], generator: Generators) -> torch.Tensor:
    """Uniforms of `shape` [b, ...] on the CPU."""
    if isinstance(generator, (list, tuple)):
        return torch.stack([torch.rand(shape[1:], generator=g, device=NOISE_DEVICE) for g in generator])
    return torch.rand(shape, generator=_one(generator), device=NOISE_DEVICE)


def draw_randint(high: int, shape: tuple[int, ...], generator: Generators) -> torch.Tensor:
    """Integers in [0, high) of `shape` [b, ...] on the CPU."""
    if isinstance(generator, (list, tuple)):
        return torch.stack([torch.randint(high, shape[1:], generator=g, device=NOISE_DEVICE) for g in generator])
    return torch.randint(high, shape, generator=_one(generator), device=NOISE_DEVICE)


def _one(generator: Generators) -> torch.Generator | None:
    """The single generator of a whole batch (callers branch on a per-row list before)."""
    assert isinstance(generator, torch.Generator) or generator is None
    return generator


def unmask_schedule(length: int, steps: int) -> list[int]:
    """How many tokens to reveal at each of `steps` steps, summing to `length` (front-loaded remainder)."""
    steps = max(1, min(steps, length))
    base, rem = divmod(length, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def timestep_count(step: int, steps: int, masked: int, eps: float) -> int:
    """Dream's timestep schedule (its generation_utils, llama.cpp's DIFFUSION_TRANSFER_SCHEDULE_TIMESTEP_BASED): at
    step i of n, t = 1 - i/n (1 - eps) and s = 1 - (i+1)/n (1 - eps); int(masked (1 - s/t)) of the masked tokens
    are committed (all of them at the last step). In float32, as llama.cpp computes it, so the counts agree at the
    integer boundaries."""
    if step >= steps - 1:
        return masked
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731 (each operation rounded to float32, as in C)
    one, n, e = f32(1.0), f32(steps), f32(eps)
    t = one - f32(step) / n * (one - e)
    s = one - f32(step + 1) / n * (one - e)
    return int(f32(masked) * (one - s / t))


REMASKING = ("low_confidence", "margin", "entropy", "random", "left_to_right")


@dataclass(frozen=True)
class MaskedSampler:
    """Settings of the masked-diffusion sampler; `asdict(settings)` is what every sample records.

    steps: denoising steps over the whole generation (split evenly across blocks), each committing a fixed
        share of the tokens (`unmask_schedule`); ignored with `threshold`.
    block_length: semi-autoregressive blocks (LLaDA): the tokens are decoded block by block, left to right;
        None decodes all of them as one block.
    remasking: which masked positions to commit: the most confident by the untempered probability of the
        chosen token (low_confidence, LLaDA), by the gap between the two most likely tokens (margin), by
        lowest entropy (entropy), at random (random), or the leftmost masked positions (left_to_right: a
        semi-autoregressive order within each block; llama.cpp's order at --top-k 1, where its confidences tie).
    threshold: Fast-dLLM's parallel decoding: every masked position of the current block whose confidence
        exceeds it is committed in the same step, at least one per step (the most confident); the number of
        steps then follows the model's confidence.
    eps: Dream's timestep schedule instead of equal shares: step i of each block's steps commits
        int(masked (1 - s/t)) tokens, t = 1 - i/steps (1 - eps), s = 1 - (i+1)/steps (1 - eps), all at the last
        step (`timestep_count`; llama.cpp's --diffusion-eps). None: equal shares (`unmask_schedule`).
    temperature / top_k / top_p: how the token at each position is drawn (0: argmax); confidence is always
        ranked on the untempered distribution, as in LLaDA.
    cfg_scale: classifier-free guidance: logits = u + (1 + w)(c - u), u with the prompt masked (LLaDA).
    stop_at_eos: a row is finished once it has committed an EOS with nothing masked before it; the rest of
        the row is filled with EOS and no longer decoded.
    prefix_cache: Fast-dLLM's prefix KV cache, for full-sequence masked models (the HF export's
        `diffusion_generate`): at the first step of each block the whole sequence is run and the keys and values
        of the prompt and the finished blocks are kept; the block's other steps run only the current block and
        what follows it against them. Approximate: under bidirectional attention the prefix would change as the
        block is unmasked (each block's first step is exact). Block-diffusion models ignore it: their KV cache is
        exact (`kv_cache`).
    kv_cache: block diffusion's exact KV cache: every finished block is run once as clean tokens and its keys and
        values are kept (the same tokens as without it, fewer model FLOPs per token); False recomputes the prefix at
        every step (to measure the cache, or to rule it out). Full-sequence models ignore it (`prefix_cache`).
    """

    steps: int = 32
    block_length: int | None = None
    remasking: str = "low_confidence"
    threshold: float | None = None
    eps: float | None = None
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    cfg_scale: float = 0.0
    stop_at_eos: bool = True
    prefix_cache: bool = False
    kv_cache: bool = True

    def __post_init__(self):
        if self.remasking not in REMASKING:
            raise ValueError(f"remasking must be one of {REMASKING}, got {self.remasking!r}")
        if self.steps < 1 or (self.block_length is not None and self.block_length < 1):
            raise ValueError("steps and block_length must be >= 1")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a confidence in [0, 1], got {self.threshold}")
        if self.threshold is not None and self.remasking == "left_to_right":
            raise ValueError("threshold needs a confidence: left_to_right remasking has none (pick one or the other)")
        if self.eps is not None and not 0.0 < self.eps <= 1.0:
            raise ValueError(f"eps is Dream's final timestep in (0, 1], got {self.eps}")
        if self.eps is not None and self.threshold is not None:
            raise ValueError("eps (a step schedule) and threshold (no schedule) exclude each other: set one")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def block_spans(length: int, block_length: int | None) -> list[tuple[int, int]]:
    """[start, end) of each block of the generated tokens."""
    size = length if not block_length else min(block_length, length)
    return [(a, min(a + size, length)) for a in range(0, length, max(size, 1))]


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Keep the top_k tokens and the smallest set whose probability reaches top_p (nucleus); -inf elsewhere."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # mass before this token already reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def _confidence(probs: torch.Tensor, pred: torch.Tensor, how: str, generator) -> torch.Tensor:
    if how == "low_confidence":
        return probs.gather(-1, pred[..., None]).squeeze(-1)
    if how == "margin":
        top2 = probs.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    if how == "entropy":
        return (probs * probs.clamp(min=1e-30).log()).sum(-1)  # minus the entropy: higher is surer
    if how == "left_to_right":  # the leftmost position ranks first
        return -torch.arange(pred.shape[-1], device=pred.device, dtype=probs.dtype).expand(pred.shape)
    return draw_rand(tuple(pred.shape), generator).to(pred.device)


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
    settings: MaskedSampler | None = None,
    eos_id: int | None = None,
    stats: dict | None = None,
    initial: torch.Tensor | None = None,
) -> torch.Tensor:
    """Generate `length` tokens after `prompt` [b, p] by iterative unmasking (LLaDA's sampler and its
    extensions, see `MaskedSampler`). Without `settings`: one block, low-confidence remasking, `steps` steps
    at `temperature`. Prompt positions are never changed. `initial` [b, length] starts the new positions
    (default: all masked); its tokens other than the mask are kept as the prompt's are and are no part of the
    generation for stop_at_eos (block decoding's prompt tail and padding). `eos_id` enables stop_at_eos.
    `stats`, when given, receives the number of model calls (`nfe`). Returns [b, p + length]."""
    cfg = settings or MaskedSampler(steps=steps, temperature=temperature, stop_at_eos=False)
    b, p = prompt.shape
    if initial is None:
        initial = torch.full((b, length), mask_id, dtype=prompt.dtype, device=prompt.device)
    fixed = initial != mask_id
    x = torch.cat([prompt, initial], dim=1)
    done = torch.zeros(b, dtype=torch.bool, device=x.device)
    spans = block_spans(length, cfg.block_length)
    steps_per_block = unmask_schedule(max(cfg.steps, len(spans)), len(spans)) if length else []
    nfe = 0
    for (a, z), block_steps in zip(spans, steps_per_block):
        in_block = torch.zeros_like(x, dtype=torch.bool)
        in_block[:, p + a : p + z] = True
        schedule = iter(unmask_schedule(z - a, block_steps))
        step = 0
        while True:
            masked = (x == mask_id) & in_block & ~done[:, None]
            if not masked.any():
                break
            n_reveal = None if cfg.threshold is not None else next(schedule, z - a)
            logits = _guided_logits(logits_fn, x, p, mask_id, cfg.cfg_scale)
            nfe += 1 + (cfg.cfg_scale > 0 and p > 0)  # guidance needs a prompt to drop: one call without
            # draws only over the generated positions: a row's draws then do not depend on its (left) padding
            pred, conf = _predict(logits[:, p:], mask_id, vocab_limit, forbidden_ids, cfg, generator)
            pred, conf = (
                torch.cat([x[:, :p], pred], dim=1),
                torch.cat([torch.zeros_like(x[:, :p], dtype=conf.dtype), conf], dim=1),
            )
            conf = torch.where(masked, conf, torch.full_like(conf, float("-inf")))
            for i in range(b):
                avail = int(masked[i].sum())
                if not avail:
                    continue
                if n_reveal is None:  # threshold: all above it, at least the most confident one
                    k = max(1, int((conf[i] > float(cfg.threshold or 0.0)).sum()))
                elif cfg.eps is not None:  # Dream's schedule: a share of what is still masked (maybe none)
                    k = timestep_count(step, block_steps, avail, cfg.eps)
                else:
                    k = min(n_reveal, avail)
                idx = conf[i].topk(k).indices
                x[i, idx] = pred[i, idx]
            step += 1
            if eos_id is not None and cfg.stop_at_eos:
                done |= _finish_at_eos(x, p, mask_id, eos_id, fixed)
    if stats is not None:
        stats["nfe"] = nfe
    return x


def _guided_logits(logits_fn: LogitsFn, x: torch.Tensor, p: int, mask_id: int, scale: float) -> torch.Tensor:
    logits = logits_fn(x).float()
    if scale <= 0 or p == 0:
        return logits
    unconditional = x.clone()
    unconditional[:, :p] = mask_id
    u = logits_fn(unconditional).float()
    return u + (1.0 + scale) * (logits - u)


def _predict(logits, mask_id, vocab_limit, forbidden_ids, cfg: MaskedSampler, generator):
    """(token drawn at every position, its confidence) from the logits; confidence untempered."""
    if vocab_limit is not None:
        logits = logits[..., :vocab_limit]
    logits[..., mask_id] = float("-inf")  # never predict the mask itself
    for tok in forbidden_ids:
        logits[..., tok] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    if cfg.temperature > 0:
        tempered = filter_logits(logits / cfg.temperature, cfg.top_k, cfg.top_p)
        pred = draw_multinomial(torch.softmax(tempered, dim=-1), generator)
    else:
        pred = probs.argmax(-1)
    return pred, _confidence(probs, pred, cfg.remasking, generator)


def _finish_at_eos(x: torch.Tensor, p: int, mask_id: int, eos_id: int, fixed: torch.Tensor) -> torch.Tensor:
    """Rows whose generated part (after `p`, not `fixed`) has a committed EOS with nothing masked before it:
    fill the rest of it with EOS."""
    gen = x[:, p:]
    is_eos = (gen == eos_id) & ~fixed
    first = torch.where(
        is_eos.any(-1), is_eos.float().argmax(-1), torch.full_like(is_eos[:, 0], gen.shape[1], dtype=torch.long)
    )
    pos = torch.arange(gen.shape[1], device=x.device)[None]
    before = pos < first[:, None]
    finished = is_eos.any(-1) & ~((gen == mask_id) & before).any(-1)
    gen[finished[:, None] & (pos > first[:, None]) & ~fixed] = eos_id
    return finished


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
    z = draw_randint(len(states), (b, length), generator).to(prompt.device)  # state indices
    steps = max(1, steps)
    for k in range(steps, 0, -1):
        t, s = k / steps, (k - 1) / steps
        x = torch.cat([prompt, states[z].to(prompt.dtype)], dim=1)
        logits = logits_fn(x, torch.full((b,), t, device=prompt.device))[:, p:]
        log_p = state_log_probs(logits, states, temperature)
        z = draw_multinomial(posterior_log_probs(log_p, z, t, s).exp(), generator)
    return torch.cat([prompt, states[z].to(prompt.dtype)], dim=1)
