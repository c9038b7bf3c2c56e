"""Decoding efficiency as the evaluation record states it: model calls (NFE), tokens per forward (TPF), tokens/s,
time to first token, peak memory, and accuracy under parallelism (AUP).

The counting follows the dllm leaderboard's protocol, so numbers compare across labs:
- `nfe` counts every forward call of the model while a sample is decoded: the sampler's denoising calls, the
  rejected positions inside them (a call counts whatever it commits), classifier-free guidance's second call, and
  the block-diffusion KV cache's fill of each finished block (a forward too). A sample of a batch rides every call
  of its batch, so its NFE is its batch's calls.
- `valid_tokens` are the generated tokens up to (not including) the first EOS: the prompt, the left padding and
  what follows the EOS are excluded.
- `tpf` = sum of valid tokens / sum of NFE over the samples (summed counters, not a mean of ratios).
Calls are counted by a forward hook on the model (`ModelCalls`), not by the sampler's own tally, so a sampler
cannot miscount itself; the sampler's tally (`model_calls`, denoising calls only) is kept beside it.

Timing boundary (`TIMING`): the wall time of the model's generate call for one batch, tokenization and
detokenization excluded, after one untimed warm-up, CUDA synchronised before the clock reads.
"""

from __future__ import annotations

import math
import platform
import resource
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

TIMING = (
    "wall time of the model's generate call per batch (tokenize/detokenize excluded), after one untimed "
    "warm-up; CUDA synchronised; tokens/s counts valid tokens"
)


class ModelCalls:
    """Counts the forward calls of `model` (a forward hook) and when the first one of a batch returned."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.calls = 0
        self.first_end: float | None = None

    def _hook(self, module, args, output) -> None:
        self.calls += 1
        if self.first_end is None:
            _sync(self.model)
            self.first_end = time.perf_counter()

    @contextmanager
    def counting(self) -> Iterator[ModelCalls]:
        """Count from zero for the duration of the block."""
        self.calls, self.first_end = 0, None
        handle = self.model.register_forward_hook(self._hook)
        try:
            yield self
        finally:
            handle.remove()


def _sync(model: torch.nn.Module) -> None:
    p = next(model.parameters(), None)
    if p is not None and p.device.type == "cuda":
        torch.cuda.synchronize(p.device)


def decode_counts(samples: list[dict]) -> dict[str, float | int | None]:
    """{nfe, valid_tokens, tpf} summed over generated samples (each carries `nfe` and `tokens`, as
    `Scorer.generate` records them). tpf None when nothing was generated."""
    nfe = sum(int(s.get("nfe") or 0) for s in samples)
    valid = sum(int(s.get("tokens") or 0) for s in samples)
    return {"nfe": nfe, "valid_tokens": valid, "tpf": valid / nfe if nfe else None}


def peak_memory(device: torch.device) -> dict[str, float | str]:
    """The peak memory and what it measures: CUDA's allocator peak since the last reset on a GPU, else the
    process's peak resident set (everything the process holds, not the decode alone)."""
    if device.type == "cuda":
        return {"peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30, "memory_kind": "cuda allocator peak"}
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"peak_memory_gb": kib / 2**20, "memory_kind": "process peak RSS"}


def speed(scorer, prompts: list[str], new_tokens: int, settings, batch_size: int, repeats: int = 5) -> dict:
    """tokens/s at batch 1 (the median of `repeats` >= 5 single-prompt runs over the first prompts, cycling) and
    at `batch_size` (all prompts once), with the median time to first token at batch 1 and the peak memory.
    One untimed warm-up first. The samples count valid tokens only (EOS-truncated)."""
    repeats = max(5, repeats)
    saved = scorer.batch_size
    device = scorer.device
    try:
        scorer.batch_size = 1
        scorer.generate(prompts[:1], new_tokens, settings)  # warm-up: allocations, kernel choices
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rates, ttft = [], []
        for k in range(repeats):
            rec = scorer.generate([prompts[k % len(prompts)]], new_tokens, settings)[0]
            rates.append(rec["tokens"] / rec["seconds"] if rec["seconds"] > 0 else math.nan)
            ttft.append(rec["ttft_s"])
        scorer.batch_size = batch_size
        batched = scorer.generate(prompts, new_tokens, settings)
        seconds = sum(r["seconds"] for r in batched)  # per-sample shares of each batch's time
        valid = sum(r["tokens"] for r in batched)
    finally:
        scorer.batch_size = saved
    return {
        "tokens_per_s_batch1": statistics.median(rates),
        "tokens_per_s_batch1_runs": rates,
        "ttft_s_batch1": statistics.median(ttft),
        "batch_size": batch_size,
        "tokens_per_s_batched": valid / seconds if seconds > 0 else None,
        **peak_memory(device),
        "timing": TIMING,
        "host": platform.node(),
    }


def weight(y: float, y_max: float, alpha: float = 3.0) -> float:
    """d3LLM's quality weight W(y) = min(exp(-alpha (1 - y / y_max)), 1): a point that lost accuracy counts less."""
    return min(math.exp(-alpha * (1 - y / y_max)), 1.0) if y_max > 0 else 0.0


def aup(
    points: list[tuple[float, float]], alpha: float = 3.0, floor_drop: float = 5.0, y_max: float | None = None
) -> float | None:
    """Accuracy under parallelism (d3LLM) of (tpf, accuracy in percent) points, one per decoding setting: the area
    under accuracy x W(accuracy) against TPF, from 0 to the first point as a rectangle and trapezoids after it,
    over the points no more than `floor_drop` points below the least parallel one's accuracy. Higher is better: a
    decoder that keeps its accuracy as TPF grows scores its TPF x accuracy. `y_max`: the best accuracy of every
    method compared (d3LLM normalises by it), default the points' own. None without points."""
    pts = sorted((r, y) for r, y in points if r and r > 0 and y is not None and not math.isnan(y))
    if not pts:
        return None
    floor = pts[0][1] - floor_drop
    pts = [(r, y) for r, y in pts if y >= floor]
    y_max = y_max if y_max is not None else max(y for _, y in pts)
    h = [y * weight(y, y_max, alpha) for _, y in pts]
    area = pts[0][0] * h[0]
    for i in range(1, len(pts)):
        area += (pts[i][0] - pts[i - 1][0]) * (h[i] + h[i - 1]) / 2
    return area
