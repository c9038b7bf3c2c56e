"""Quality and speed of a sampler: cloze accuracy of generated words and generated tokens per second.

The same measurement serves the `evaluate` flow's sweep over steps and `benchmarks/generate.py`'s sampler
comparison: each cloze item's context is continued by `new_tokens` tokens, and an item is right when the
first word generated equals the target word (case and punctuation ignored, as lm-eval's exact_match).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, replace

from difflm.models.diffusion import MaskedSampler


def first_word(text: str) -> str:
    m = re.search(r"[A-Za-z0-9'-]+", text)
    return m.group().lower() if m else ""


def measure_sampler(scorer, items: list[dict], settings: MaskedSampler, new_tokens: int = 4) -> dict:
    """{accuracy, tokens_per_s, model_calls per item, seconds} of `settings` on the cloze items."""
    contexts = [it["context"] for it in items]
    t0 = time.perf_counter()
    records = scorer.generate(contexts, new_tokens, settings)
    seconds = time.perf_counter() - t0
    hits = [first_word(r["completion"]) == it["target"].lower() for r, it in zip(records, items)]
    calls = [r["model_calls"] or 0 for r in records]
    # model_calls is per batch; every item of a batch shares it
    return {
        "accuracy": sum(hits) / max(len(hits), 1),
        "tokens_per_s": len(items) * new_tokens / seconds,
        "model_calls": sum(calls) / max(len(calls), 1),
        "seconds": seconds,
        "items": len(items),
        "new_tokens": new_tokens,
        "sampler": asdict(settings),
    }


def sweep_steps(
    scorer, items: list[dict], base: MaskedSampler, steps: list[int], new_tokens: int = 4, echo=None
) -> list[dict]:
    """measure_sampler at each number of steps (threshold off: the steps are what varies); `echo`: a line per
    setting as it is measured (each takes a while on a CPU)."""
    rows = []
    for i, k in enumerate(steps, 1):
        rows.append({"steps": k, **measure_sampler(scorer, items, replace(base, steps=k, threshold=None), new_tokens)})
        if echo:
            r = rows[-1]
            echo(f"[sweep] {i}/{len(steps)}: {k} steps, " + ", ".join(f"{m} {r[m]:.3g}" for m in METRICS if m in r))
    return rows


METRICS = ("accuracy", "tokens_per_s")  # what a sweep line shows, when measured
