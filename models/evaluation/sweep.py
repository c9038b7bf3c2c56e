"""Generation scored by exact match, and its quality and speed across decoding settings.

The generative task (`cloze_gen`, the same items and stop sequences as lm-eval's `difflm_cloze_gen` YAML): each
cloze item's context is continued by `new_tokens` tokens with one sampler setting, cut at the first stop sequence,
and scored by two answer filters:
- strict: the cut completion, stripped, equals the target word exactly;
- flexible: its first word equals the target, case and punctuation ignored (lm-eval's exact_match with
  ignore_case and ignore_punctuation).
Every sample keeps its prompt, output, scores, valid tokens and model calls, so TPF (efficiency.py) comes from
the same generations that were scored. The evaluate flow's sweep and `benchmarks/generate.py` measure a setting
the same way (`measure_sampler`), one row per setting; AUP is computed over those rows.
"""

from __future__ import annotations

import re
from dataclasses import asdict, replace

from difflm.models.diffusion import MaskedSampler
from difflm.models.evaluation.efficiency import aup, decode_counts
from difflm.models.evaluation.tasks import stderr_of_mean

STOP = [".", "\n", ",", ";"]  # lm-eval's difflm_cloze_gen `until` (tasks._task_yaml)
FILTERS = {
    "strict": "the completion cut at the first stop sequence, stripped, equals the target",
    "flexible": "the first word of the completion equals the target, case and punctuation ignored",
}


def first_word(text: str) -> str:
    m = re.search(r"[A-Za-z0-9'-]+", text)
    return m.group().lower() if m else ""


def score_generation(scorer, items: list[dict], settings: MaskedSampler, new_tokens: int, batch_size: int = 1) -> dict:
    """exact_match (strict and flexible) of generated continuations of the cloze items, with standard errors,
    NFE and TPF, and every sample. At batch 1 (the default) each sample's NFE is its own: a row batched with
    others rides their calls after it finished, which would charge it for theirs."""
    saved, scorer.batch_size = scorer.batch_size, batch_size
    try:
        records = scorer.generate([it["context"] for it in items], new_tokens, settings, until=STOP)
    finally:
        scorer.batch_size = saved
    strict = [float(r["completion"].strip() == it["target"]) for r, it in zip(records, items)]
    flexible = [float(first_word(r["completion"]) == it["target"].lower()) for r, it in zip(records, items)]
    samples = [
        {
            "prompt": it["context"],
            "target": it["target"],
            "output": r["completion"],
            "strict": s,
            "flexible": f,
            "tokens": r["tokens"],
            "nfe": r["nfe"],
            "seconds": r["seconds"],
        }
        for r, it, s, f in zip(records, items, strict, flexible)
    ]
    n = max(len(items), 1)
    return {
        "exact_match_strict": sum(strict) / n,
        "exact_match_strict_stderr": stderr_of_mean(strict),
        "exact_match_flexible": sum(flexible) / n,
        "exact_match_flexible_stderr": stderr_of_mean(flexible),
        "items": len(items),
        **decode_counts(samples),
        "seconds": sum(r["seconds"] for r in records),
        "samples": samples,
    }


def measure_sampler(scorer, items: list[dict], settings: MaskedSampler, new_tokens: int = 4) -> dict:
    """{accuracy (flexible exact match), tokens_per_s (valid tokens), nfe, tpf, model_calls per item, seconds} of
    `settings` on the cloze items."""
    res = score_generation(scorer, items, settings, new_tokens)
    calls = [s["nfe"] for s in res["samples"]]
    return {
        "accuracy": res["exact_match_flexible"],
        "accuracy_strict": res["exact_match_strict"],
        "tokens_per_s": res["valid_tokens"] / res["seconds"] if res["seconds"] > 0 else None,
        "nfe": res["nfe"],
        "tpf": res["tpf"],
        "valid_tokens": res["valid_tokens"],
        "model_calls": sum(calls) / max(len(calls), 1),
        "seconds": res["seconds"],
        "items": len(items),
        "new_tokens": new_tokens,
        "sampler": asdict(settings),
    }


def sweep_steps(
    scorer,
    items: list[dict],
    base: MaskedSampler,
    steps: list[int],
    new_tokens: int = 4,
    echo=None,
    thresholds: list[float] | None = None,
) -> list[dict]:
    """measure_sampler at each number of steps (threshold off: the steps are what varies), then at each confidence
    threshold (Fast-dLLM); `echo`: a line per setting as it is measured (each takes a while on a CPU)."""
    settings = [("steps", k, replace(base, steps=k, threshold=None)) for k in steps]
    settings += [("threshold", th, replace(base, threshold=th)) for th in thresholds or []]
    rows = []
    for i, (kind, value, s) in enumerate(settings, 1):
        row = {"steps": s.steps, "setting": f"{kind} {value}", **measure_sampler(scorer, items, s, new_tokens)}
        rows.append(row)
        if echo:
            label = f"{value} steps" if kind == "steps" else f"threshold {value}"
            echo(
                f"[sweep] {i}/{len(settings)}: {label}, "
                + ", ".join(f"{m} {row[m]:.3g}" for m in METRICS if row.get(m) is not None)
            )
    return rows


def sweep_aup(rows: list[dict], y_max: float | None = None) -> float | None:
    """AUP (efficiency.aup) of a sweep's rows: TPF against flexible exact match in percent."""
    return aup([(r["tpf"], 100 * r["accuracy"]) for r in rows if r.get("tpf")], y_max=y_max)


METRICS = ("accuracy", "tpf", "tokens_per_s")  # what a sweep line shows, when measured
