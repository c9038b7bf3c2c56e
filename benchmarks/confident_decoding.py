"""Decoding speed-ups on a model that is confident: threshold and block decoding against one token per step and
against AR with its KV cache, at equal output, measured in one run on one machine.

    .venv/bin/python benchmarks/confident_decoding.py [--workdir DIR] [--items 16] [--new-tokens 24] [--block]
        [--batch-size 8] [--threads 1] [--out PATH.md]

On the demo's model (docs/benchmarks.md, Samplers) threshold decoding gains nothing: that model is never sure of a
token, so it commits one per step. Here every model is trained (the pipeline's own data prep, torchrun training and
export, preset test-tiny with `OVERRIDES`) on a corpus with predictable continuations, written from a seed
(`write_corpus`): each document repeats one of 32 words, a copy task. A prompt of four repeats names the word, so
every later token is determined and a trained model becomes sure of it: the best case for parallel decoding, which
shows what the decoders do when the model is sure, not how sure a language model is.

Rows, on the same prompts: the masked model one token per step (the baseline), threshold 0.9, threshold 0.9 in
blocks of 8; the block-diffusion model (`--block`) one token per step and threshold 0.9, both with its exact KV
cache; the AR model with its KV cache. Per row: NFE (model calls counted by a forward hook), valid tokens and TPF
as `models/evaluation/efficiency.py` defines them (batch 1: each prompt decoded alone), tokens/s at batch 1 (the
median of a run per prompt) and batched (`efficiency.speed`), `same` (the share of completions identical to the
masked baseline's) and `score` (the share of completions that continue the prompt correctly: the task score,
comparable across models). Decoding runs on `--threads` torch threads (default 1).

Writes benchmarks/results/confident-decoding-<date>.{md,json} (or --out) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

from difflm.config import PipelineConfig, load_config  # noqa: E402
from difflm.data_prep.pipeline import prepare_data  # noqa: E402
from difflm.models.diffusion import MaskedSampler  # noqa: E402
from difflm.models.evaluation.efficiency import decode_counts, speed  # noqa: E402
from difflm.models.evaluation.scoring import Scorer  # noqa: E402
from difflm.models.evaluation.stages import convert_checkpoint, load_model, load_tokenizer  # noqa: E402
from difflm.models.launch.torchrun import launch_training  # noqa: E402

# 32 words; a document repeats one of them (a copy task): the prompt names the word, so every later token is
# determined by the prompt's tokens whatever their positions, which a model this small learns in a hundred steps.
# (Cycles of four words, "north east south west north ...", were tried first: 400 steps at the same size learnt
# each cycle but not the phase, a position that attention must learn, and left the model unsure; 1,500 steps learnt
# most of it, still short of equal output: docs/benchmarks.md.)
WORDS = tuple(
    """north east south west spring summer autumn winter red green blue yellow alpha bravo charlie delta monday
    tuesday wednesday thursday apple pear plum cherry lion tiger bear wolf iron copper silver gold""".split()
)
PROMPT_WORDS = 4
SEQ_LENGTH = 32  # test-tiny's train.seq_length, the exports' positions

# On top of preset test-tiny: the model a little wider (64, 4 heads) and trained long enough, at a rate high enough,
# to be sure of the data (MODE_OVERRIDES: what each mode adds)
OVERRIDES = (
    "data.min_chars=0",
    "data.max_documents=null",
    "data.valid_fraction=0.05",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "train.micro_batch_size=16",
    "train.global_batch_size=16",
    "train.train_iters=150",
    "train.torch_threads=1",  # a model this small: a second thread costs more CPU than it saves
    "train.optimizer.lr=1e-2",
    "train.schedule.warmup_iters=20",
    "train.log_interval=50",
    "train.eval_interval=150",
    "checkpoint.save_interval=150",
)
MODE_OVERRIDES = {
    "difflm-noshift": (),
    "ar": (),
    "difflm-block": ("diffusion.block_size=8",),
}

BASELINE = "masked, 1 token/step (baseline)"


def repeated(rng: random.Random, words: int) -> list[str]:
    """A random word, `words` times."""
    return [rng.choice(WORDS)] * words


def write_corpus(path: Path, seed: int = 0, documents: int = 400) -> Path:
    """A JSONL corpus of `documents` repeats of 40-80 words (about 24k tokens), the same for the same seed."""
    rng = random.Random(seed)
    lines = (json.dumps({"text": " ".join(repeated(rng, rng.randint(40, 80)))}) for _ in range(documents))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def prompts(items: int, seed: int = 1) -> list[tuple[str, list[str]]]:
    """(prompt of PROMPT_WORDS words, the 64 words that follow it) for `items` repeats (a seed other than the
    corpus's: another draw of the words)."""
    rng = random.Random(seed)
    out = []
    for _ in range(items):
        words = repeated(rng, PROMPT_WORDS + 64)
        out.append((" ".join(words[:PROMPT_WORDS]), words[PROMPT_WORDS:]))
    return out


def config(workdir: Path, mode: str, *more: str) -> PipelineConfig:
    corpus = write_corpus(Path(workdir) / "corpus" / "repeats.jsonl")
    return load_config(
        "test-tiny",
        [
            f"workdir={workdir}",
            f"data.sources=[{corpus}]",
            f"diffusion.model_running_mode={mode}",
            *OVERRIDES,
            *MODE_OVERRIDES[mode],
            *more,
        ],
    )


def train(workdir: Path, mode: str, *more: str, echo=lambda _: None) -> Path:
    """The export of `mode` trained on the copy corpus (the pipeline's stages; a finished run is reused)."""
    cfg = config(workdir, mode, *more)
    manifest = prepare_data(cfg)
    return convert_checkpoint(cfg, manifest, launch_training(cfg, manifest, echo=echo)).folder


def continues(completion: str, truth: list[str]) -> bool:
    """Whether the completion's words continue the prompt (its last word may be cut short by the token budget)."""
    words = completion.split()
    if not words:
        return False
    whole, last = words[:-1], words[-1]
    return len(whole) < len(truth) and whole == truth[: len(whole)] and truth[len(whole)].startswith(last)


def measure(scorer: Scorer, items, n: int, fields: dict, batch_size: int, reference: list[str] | None) -> dict:
    """One row: counts and outputs at batch 1 (every prompt alone), then tokens/s (`efficiency.speed`, which puts
    the scorer's batch size back); `reference`: the baseline's completions (None: this row is the baseline)."""
    settings = replace(MaskedSampler(steps=n, stop_at_eos=False), **fields)
    texts = [p for p, _ in items]
    saved, scorer.batch_size = scorer.batch_size, 1
    try:
        recs = scorer.generate(texts, n, settings)
    finally:
        scorer.batch_size = saved
    completions = [r["completion"] for r in recs]
    reference = reference or completions
    rates = speed(scorer, texts, n, settings, batch_size, repeats=len(texts))  # median of a run per prompt
    return {
        **decode_counts(recs),
        "same": sum(a == b for a, b in zip(completions, reference)) / len(items),
        "score": sum(continues(c, truth) for c, (_, truth) in zip(completions, items)) / len(items),
        "tokens_per_s_batch1": rates["tokens_per_s_batch1"],
        "tokens_per_s_batched": rates["tokens_per_s_batched"],
        "batch_size": batch_size,
        "settings": fields,
        "completions": completions,
    }


def decoders(n: int, block: bool) -> list[tuple[str, str, dict]]:
    """(row, mode of its model, MaskedSampler fields); the first is the baseline."""
    rows = [
        (BASELINE, "difflm-noshift", dict(steps=n)),
        ("masked, threshold 0.9", "difflm-noshift", dict(threshold=0.9)),
        ("masked, threshold 0.9, blocks of 8", "difflm-noshift", dict(threshold=0.9, block_length=8)),
    ]
    if block:
        rows += [
            ("block diffusion + KV cache, 1 token/step", "difflm-block", dict(steps=n)),
            ("block diffusion + KV cache, threshold 0.9", "difflm-block", dict(threshold=0.9)),
        ]
    return [*rows, ("AR + KV cache (greedy)", "ar", {})]


def run(exports: dict[str, Path], items: int = 16, n: int = 24, batch_size: int = 8, block: bool = False) -> dict:
    """Every row of `decoders` on the same prompts, in this process: {rows: [...], machine fields}."""
    asked = prompts(items)
    scorers = {}
    for mode, folder in exports.items():
        model = load_model(folder)
        scorers[mode] = Scorer(model, load_tokenizer(folder), batch_size=batch_size)
    rows, reference = [], None
    for name, mode, fields in decoders(n, block):
        if mode not in scorers:
            continue
        row = measure(scorers[mode], asked, n, fields, batch_size, reference)
        reference = reference or row["completions"]
        rows.append({"decoder": name, "mode": mode, **row})
    return {
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "items": items,
        "new_tokens": n,
        "exports": {m: str(f) for m, f in exports.items()},
        "rows": rows,
    }


def table(result: dict) -> str:
    base = result["rows"][0]
    lines = [
        "| decoder | NFE | valid tokens | TPF | tokens/s, batch 1 | tokens/s, batch "
        f"{base['batch_size']} | vs baseline (batch 1) | same as baseline | score |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['decoder']} | {r['nfe']} | {r['valid_tokens']} | {r['tpf']:.2f} | {r['tokens_per_s_batch1']:.0f} "
            f"| {r['tokens_per_s_batched']:.0f} | {r['tokens_per_s_batch1'] / base['tokens_per_s_batch1']:.2f}x "
            f"| {r['same']:.2f} | {r['score']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=ROOT / ".difflm-confident", help="data, runs and exports")
    p.add_argument("--items", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads while decoding (1: a model this small runs thousands of "
        "tiny ops, faster on one thread and steadier on a shared machine)",
    )
    p.add_argument("--block", action="store_true", help="also train and measure a block-diffusion model")
    p.add_argument("--out", type=Path, help="the table's path, .md (and .json beside it)")
    args = p.parse_args()
    if not 0 < args.new_tokens <= SEQ_LENGTH - PROMPT_WORDS:  # a prompt word is one token: both fit the positions
        sys.exit(
            f"--new-tokens {args.new_tokens}: give 1 to {SEQ_LENGTH - PROMPT_WORDS} (the models' {SEQ_LENGTH} positions hold the prompt too)"
        )
    modes = ["difflm-noshift", *(["difflm-block"] if args.block else []), "ar"]
    exports = {}
    for mode in modes:
        t0 = time.perf_counter()
        exports[mode] = train(args.workdir, mode)
        print(f"[{mode}] export {exports[mode]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    torch.set_num_threads(args.threads)
    result = run(exports, args.items, args.new_tokens, args.batch_size, args.block)
    out = args.out or ROOT / "benchmarks" / "results" / f"confident-decoding-{result['date']}.md"
    text = (
        f"{result['date']}, {result['host']} ({result['processor']}, {result['threads']} torch threads, torch "
        f"{result['torch']}): {result['items']} prompts of {PROMPT_WORDS} words, {result['new_tokens']} new tokens\n\n"
        + table(result)
        + "\n"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(text + f"\nwritten: {out} and {out.with_suffix('.json').name}")


if __name__ == "__main__":
    main()
