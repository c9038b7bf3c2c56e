"""Samplers of masked diffusion side by side on one export: generated tokens/s, task accuracy, and how far
each strays from the baseline, one-token-per-step low-confidence decoding, measured in the same run.

    .venv/bin/python benchmarks/generate.py [SOURCE] [--items 48] [--new-tokens 32] [--preset tiny-cpu] [k=v ...]

SOURCE: an export folder, run directory or models:/name/version (default: the newest difflm-noshift run of
the preset's workdir, e.g. after `make demo`). The data is SOURCE's own (the config and data its run recorded)
unless --preset names another, or SOURCE belongs to no run (then tiny-cpu's). The items are the cloze task of
the held-out split (the
context up to the last word of a sentence): each sampler continues every context by --new-tokens tokens;
`accuracy` is the share whose first generated word is the target, `agreement` the share of generated
tokens equal to the baseline's. Greedy everywhere (temperature 0), so differences come from the sampler.
Goal: threshold decoding >= 3x the baseline's tokens/s at <= 1 point of accuracy lost.

The prefix-cache row (`prefix_cache=True`, Fast-dLLM's, approximate) reuses the keys and values of the prompt
and finished blocks within each block: its agreement with the uncached "blocks of 8" row is what the
approximation costs.

`--block SOURCE` and `--ar SOURCE` (or the newest difflm-block / ar exports of the workdir, when there are any)
add rows for block diffusion (block by block, with its exact KV cache and without it: `kv_cache=False`,
eval.sampler.kv_cache, recomputes the prefix at every step) and for AR decoding with its cache, on the same
items (`--others-only`: the baseline row and these): tokens/s, model calls per generated token, and agreement with the baseline (other
models: agreement is only indicative). Train them at the same size to compare decoders, e.g.
`difflm run --preset tiny-cpu diffusion.model_running_mode=difflm-block`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from data_prep.pipeline import prepare_data
from difflm.config import PipelineConfig, load_config
from difflm.rundir import RunDir, Workdir
from models.diffusion import MaskedSampler
from models.evaluation.scoring import Scorer
from models.evaluation.sources import resolve_export
from models.evaluation.stages import load_model, load_tokenizer
from models.evaluation.sweep import first_word
from models.evaluation.tasks import cloze_items, heldout_documents


def samplers(n: int) -> dict[str, dict]:
    """name -> MaskedSampler fields; the first is the baseline."""
    return {
        "low-confidence, 1 token/step (baseline)": dict(steps=n),
        "low-confidence, 2 tokens/step": dict(steps=max(1, n // 2)),
        "low-confidence, 4 tokens/step": dict(steps=max(1, n // 4)),
        "blocks of 8, 1 token/step": dict(steps=n, block_length=8),
        "margin, 1 token/step": dict(steps=n, remasking="margin"),
        "entropy, 1 token/step": dict(steps=n, remasking="entropy"),
        "random, 1 token/step": dict(steps=n, remasking="random"),
        "threshold 0.9 (Fast-dLLM)": dict(threshold=0.9),
        "threshold 0.7 (Fast-dLLM)": dict(threshold=0.7),
        "threshold 0.9, blocks of 8": dict(threshold=0.9, block_length=8),
        # Fast-dLLM's prefix cache: each block's later steps skip the prompt and earlier blocks (approximate)
        "blocks of 8, 1 token/step + prefix cache": dict(steps=n, block_length=8, prefix_cache=True),
    }


def newest_run(workdir: Path, mode: str = "difflm-noshift", required: bool = True) -> str | None:
    runs = sorted(Workdir(workdir).runs.glob(f"{mode}-*/hf/config.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        if not required:
            return None
        sys.exit(f"no {mode} export under {workdir}/runs: run `make demo` first or pass SOURCE")
    return str(runs[-1].parent)


def other_decoders(n: int) -> dict[str, dict]:
    """name -> MaskedSampler fields of the block-diffusion export's rows (its blocks come from the model)."""
    return {
        "block diffusion + KV cache, 1 token/step": dict(steps=n),
        "block diffusion + KV cache, threshold 0.9": dict(threshold=0.9),
        "block diffusion, no KV cache, 1 token/step": dict(steps=n, kv_cache=False),
    }


def source_config(source: str | None, preset: str | None, overrides: list[str]) -> PipelineConfig:
    """The config of SOURCE's own run (its data) unless --preset is given; else the preset's (default tiny-cpu)."""
    run = None
    if source and not preset and not source.startswith("models:/"):
        run = RunDir.holding(Path(source).expanduser())
    if run is not None and run.has_inputs():
        return run.config(overrides)
    return load_config(preset or "tiny-cpu", overrides)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", nargs="?", help="export folder, run directory or models:/name/version")
    p.add_argument(
        "--preset", default=None, help="the config whose held-out data gives the items (default: SOURCE's run's)"
    )
    p.add_argument("--others-only", action="store_true", help="only the baseline row, then the --block/--ar rows")
    p.add_argument("--items", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    p.add_argument("--block", help="a difflm-block export, run or models:/ URI (default: the workdir's newest)")
    p.add_argument("--ar", help="an ar export, run or models:/ URI (default: the workdir's newest)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = p.parse_intermixed_args()

    cfg = source_config(args.source, args.preset, args.overrides)
    folder = resolve_export(args.source or newest_run(Path(cfg.workdir)))
    model, tok = load_model(folder), load_tokenizer(folder)
    if not model.objective.unmasks:
        sys.exit(f"{folder} is a {model.config.model_running_mode} model: these samplers are for masked diffusion")
    items = cloze_items(heldout_documents(prepare_data(cfg), tok), args.items, cfg.eval.seed)
    torch.set_num_threads(torch.get_num_threads())
    scorer = Scorer(model, tok, batch_size=args.batch_size, seed=cfg.eval.seed)
    contexts = [it["context"] for it in items]
    n = args.new_tokens
    rows, baseline = [], None
    n_batches = max(1, -(-len(items) // args.batch_size))

    def measure(scorer, name: str, fields: dict) -> None:
        nonlocal baseline
        settings = replace(MaskedSampler(stop_at_eos=False), **fields)
        t0 = time.perf_counter()
        recs = scorer.generate(contexts, n, settings)
        seconds = time.perf_counter() - t0
        tokens = [tok.encode(r["completion"], add_special_tokens=False) for r in recs]
        if baseline is None:
            baseline = tokens
        agree = sum(sum(a == b for a, b in zip(t, bt)) for t, bt in zip(tokens, baseline))
        total = sum(max(len(bt), 1) for bt in baseline)
        calls = sum(r["model_calls"] for r in recs[:: args.batch_size])  # one record per batch carries its calls
        rows.append(
            {
                "sampler": name,
                "tokens_per_s": len(items) * n / seconds,
                "seconds": seconds,
                "model_calls_per_batch": calls / n_batches,
                "model_calls_per_token": calls / n_batches / n,
                "accuracy": sum(first_word(r["completion"]) == it["target"].lower() for r, it in zip(recs, items))
                / len(items),
                "agreement": agree / total,
                "settings": {
                    **fields,
                    **{k: v for k, v in recs[0]["sampler"].items() if k in ("block_size", "kv_cache")},
                },
            }
        )

    scorer.generate(contexts[: args.batch_size], n, MaskedSampler(steps=n))  # warm-up, not timed
    for i, (name, fields) in enumerate(samplers(n).items()):
        if i == 0 or not args.others_only:
            measure(scorer, name, fields)
    for mode, source, decoders in (
        ("difflm-block", args.block, other_decoders(n)),
        ("ar", args.ar, {"autoregressive + KV cache (greedy)": {}}),
    ):
        source = source or newest_run(Path(cfg.workdir), mode, required=False)
        if source is None:
            continue
        other = load_model(resolve_export(source))
        other_scorer = Scorer(
            other, load_tokenizer(resolve_export(source)), batch_size=args.batch_size, seed=cfg.eval.seed
        )
        other_scorer.generate(contexts[: args.batch_size], n, MaskedSampler(steps=n))  # warm-up
        for name, fields in decoders.items():
            measure(other_scorer, name, fields)
    base = rows[0]
    print(
        f"\nexport: {folder}\n{len(items)} cloze items, {n} new tokens each, batch {args.batch_size}, "
        f"{torch.get_num_threads()} CPU threads\n"
    )
    print(
        "| sampler | tokens/s | speed-up | model calls / batch | calls / token | cloze accuracy | agreement with baseline |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['sampler']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{r['model_calls_per_batch']:.1f} | {r['model_calls_per_token']:.2f} | {r['accuracy']:.3f} | "
            f"{r['agreement']:.3f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"export": str(folder), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
