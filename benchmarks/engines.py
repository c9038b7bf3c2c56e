"""Tokens/s of llama.cpp's `llama-diffusion-cli` against `difflm generate`'s sampler on the same model, prompts and
settings, on this machine in one run.

    .venv/bin/python benchmarks/engines.py EXPORT GGUF [--prompt TEXT ...] [--length 64] [--steps 16]
        [--block-length 16 | --eps 1e-3] [--threads 2] [--record EVAL_FOLDER] [--out PATH.md]

EXPORT is our HF export of a run (`<run>/hf`, what `difflm generate` loads) and GGUF the same checkpoint written by
`difflm convert RUN --format gguf` (`<out>/model.gguf`). Both decode each prompt at batch 1 with the matching
settings (deploy/llama_cpp.py, docs/engines.md): argmax tokens committed leftmost first (llama.cpp at --temp 0
--top-k 1, its confidence algorithm; ours remasking=left_to_right), `--length` positions in all (the prompt's
included: llama.cpp's -ub), `--steps` steps in LLaDA's blocks of `--block-length` (or Dream's eps schedule), on
`--threads` threads (llama.cpp's -t, torch's threads). Timed: the decoding loop alone (llama.cpp's own "total time"
line; ours around `diffusion_generate`, the model loaded and warmed up once), so loading a model is not counted;
llama.cpp's whole process time (loading the GGUF included) is a column apart. `same` counts the prompts whose
texts are equal.

Prints the table and writes benchmarks/results/engines-<date>.{md,json} (or --out); `--record` adds a row per engine
to an evaluation's record (`engines` in its results.json: engine, version, tokens/s, settings).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

from deploy import llama_cpp  # noqa: E402
from difflm.models.evaluation.protocol import environment  # noqa: E402
from difflm.models.evaluation.record import EvalRecord  # noqa: E402
from difflm.models.evaluation.stages import load_model, load_tokenizer  # noqa: E402

PROMPTS = ("the cat sat on", "once upon a time", "in the morning the", "she said that")


def ours(model, tok, meta: dict, prompt: str, length: int, settings) -> tuple[str, int, float]:
    """(text, generated tokens, seconds of the decoding loop) of our sampler on llama.cpp's canvas."""
    ids = llama_cpp.prompt_ids(meta, tok.encode(prompt, add_special_tokens=False))
    llama_cpp.check_canvas(len(ids), length, settings.steps, settings.block_length)
    t = time.perf_counter()
    seq = model.diffusion_generate(torch.tensor([ids]), length - len(ids), settings.steps, settings=settings)
    seconds = time.perf_counter() - t
    new = seq[0, len(ids) :].tolist()
    return llama_cpp.our_text(tok, meta, new), len(new), seconds


def measure(export: Path, gguf: Path, prompts: list[str], length: int, steps: int, schedule: dict, threads: int):
    torch.set_num_threads(threads)
    model, tok = load_model(export), load_tokenizer(export)
    meta = llama_cpp.gguf_metadata(gguf)
    settings = llama_cpp.matching_sampler(steps, **schedule)
    ours(model, tok, meta, prompts[0], length, settings)  # warm-up: first calls allocate
    rows = {"llama.cpp": [0, 0.0, 0.0], "difflm": [0, 0.0, 0.0]}  # tokens, loop seconds, process seconds
    same = 0
    for prompt in prompts:
        text, n, seconds = ours(model, tok, meta, prompt, length, settings)
        rows["difflm"][0] += n
        rows["difflm"][1] += seconds
        t = time.perf_counter()
        got = llama_cpp.generate(gguf, prompt, length=length, steps=steps, threads=threads, **schedule)
        rows["llama.cpp"][2] += time.perf_counter() - t
        rows["llama.cpp"][0] += n  # the same canvas: the same number of generated positions
        rows["llama.cpp"][1] += got.seconds
        same += got.text == text
    config = {"length": length, "steps": steps, **schedule, "threads": threads, "prompts": len(prompts)}
    env = environment()
    ours_version = f"{env['difflm']} ({(env['commit'] or '?')[:7]}), torch {env['torch']}"
    versions = {"llama.cpp": f"llama-cpp-python {llama_cpp.VERSION} (vendor/llama.cpp)", "difflm": ours_version}
    settings_of = {
        "llama.cpp": "--temp 0 --top-k 1 --diffusion-algorithm 4 (confidence)",
        "difflm": "remasking=left_to_right, temperature 0",
    }
    return [
        {
            "engine": engine,
            "version": versions[engine],
            "tokens_per_s": tokens / seconds,
            "tokens": tokens,
            "seconds": seconds,
            "process_seconds": process or None,
            "same_text": same,
            "sampler": settings_of[engine],
            "settings": config,
            "model": str(gguf if engine == "llama.cpp" else export),
        }
        for engine, (tokens, seconds, process) in rows.items()
    ]


def table(rows: list[dict]) -> str:
    c = rows[0]["settings"]
    schedule = f"blocks of {c['block_length']}" if c.get("block_length") else f"eps {c.get('eps')}"
    lines = [
        f"{c['prompts']} prompts, {c['length']} positions (prompt included), {c['steps']} steps, {schedule}, batch 1, "
        f"{c['threads']} threads; {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
        "",
        "| engine | version | tokens/s | decoding s | with model load s | same text |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        process = f"{r['process_seconds']:.2f}" if r["process_seconds"] else "-"
        lines.append(
            f"| {r['engine']} | {r['version']} | {r['tokens_per_s']:.0f} | {r['seconds']:.2f} | {process} | "
            f"{r['same_text']}/{c['prompts']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export", type=Path, help="our HF export (<run>/hf)")
    p.add_argument("gguf", type=Path, help="the GGUF of the same checkpoint (difflm convert RUN --format gguf)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat the flag); default: four short ones")
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--block-length", type=int)
    p.add_argument("--eps", type=float)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--record", type=Path, help="an evaluation's folder: its results.json gets the engines' rows")
    p.add_argument("--out", type=Path, help="the .md to write (default benchmarks/results/engines-<date>.md)")
    a = p.parse_args()
    if a.block_length and a.eps:
        p.error("--block-length (LLaDA's blocks) or --eps (Dream's schedule), not both")
    schedule = {"eps": a.eps} if a.eps else {"block_length": a.block_length or 16}
    if not llama_cpp.built():
        sys.exit(f"llama.cpp {llama_cpp.VERSION} is not built: make llama-cpp")
    rows = measure(a.export, a.gguf, list(a.prompt or PROMPTS), a.length, a.steps, schedule, a.threads)
    text = table(rows)
    print(text)
    out = a.out or ROOT / "benchmarks" / "results" / f"engines-{datetime.date.today()}.md"
    out.write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    print(f"written: {out} and {out.with_suffix('.json')}")
    if a.record:
        record = EvalRecord.read(a.record)
        keep = ("engine", "version", "tokens_per_s", "sampler", "settings", "model")
        record.replace(engines=[{k: r[k] for k in keep} for r in rows]).write(a.record)
        print(f"engines' rows added to {a.record}")


if __name__ == "__main__":
    main()
