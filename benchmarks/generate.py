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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the repository's packages (benchmarks.gpu)
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.decoding import AR, measure, other_decoders, samplers, warm_up  # noqa: E402
from difflm.config import PipelineConfig, load_config  # noqa: E402
from difflm.data_prep.pipeline import prepare_data  # noqa: E402
from difflm.models.evaluation.scoring import Scorer  # noqa: E402
from difflm.models.evaluation.sources import resolve_export  # noqa: E402
from difflm.models.evaluation.stages import load_model, load_tokenizer  # noqa: E402
from difflm.models.evaluation.sweep import first_word  # noqa: E402
from difflm.models.evaluation.tasks import cloze_items, heldout_documents  # noqa: E402
from difflm.rundir import RunDir, Workdir  # noqa: E402


def newest_run(workdir: Path, mode: str = "difflm-noshift", required: bool = True) -> str | None:
    runs = sorted(Workdir(workdir).runs.glob(f"{mode}-*/hf/config.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        if not required:
            return None
        sys.exit(f"no {mode} export under {workdir}/runs: run `make demo` first or pass SOURCE")
    return str(runs[-1].parent)


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
    rows: list[dict] = []
    baseline: list[list[int]] | None = None

    def run(scorer, name: str, fields: dict) -> None:
        nonlocal baseline
        row, recs, tokens = measure(scorer, contexts, n, name, fields, baseline)
        baseline = baseline or tokens
        hits = sum(first_word(r["completion"]) == it["target"].lower() for r, it in zip(recs, items))
        rows.append({**row, "accuracy": hits / len(items)})

    warm_up(scorer, contexts, n)
    for i, (name, fields) in enumerate(samplers(n).items()):
        if i == 0 or not args.others_only:
            run(scorer, name, fields)
    for mode, source, decoders in (
        ("difflm-block", args.block, other_decoders(n)),
        ("ar", args.ar, {AR: {}}),
    ):
        source = source or newest_run(Path(cfg.workdir), mode, required=False)
        if source is None:
            continue
        other = load_model(resolve_export(source))
        other_scorer = Scorer(
            other, load_tokenizer(resolve_export(source)), batch_size=args.batch_size, seed=cfg.eval.seed
        )
        warm_up(other_scorer, contexts, n)
        for name, fields in decoders.items():
            run(other_scorer, name, fields)
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
