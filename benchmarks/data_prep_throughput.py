"""Data-prep throughput: tokens/s and peak memory of the datatrove pipeline with 1 and 2 workers on
the demo corpus, against the raw throughput of the tokenizer alone on the same text (the ceiling).

    .venv/bin/python benchmarks/data_prep_throughput.py [--repeat 4] [--workers 1 2]

The corpus is repeated (with a counter so that no document is a duplicate) to make the run long
enough to measure. Each case runs in a fresh process so peak RSS is its own (children included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Each case runs in its own process whose peak RSS is the measurement: a case imports only what it runs (the
# tokenizer-only ceiling never loads datatrove), so the imports stay inside the functions.


def corpus(repeat: int, folder: Path) -> Path:
    from data_prep.corpus import demo_corpus

    docs = [json.loads(line) for line in demo_corpus().read_text().splitlines()]
    out = folder / "corpus.jsonl"
    with out.open("w") as f:
        for r in range(repeat):
            for d in docs:
                f.write(json.dumps({"text": f"[{r}] " + d["text"]}) + "\n")
    return out


def tokenizer_ceiling(path: Path, tokenizer_json: str) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    tic = time.perf_counter()
    n = sum(len(e.ids) + 1 for e in tok.encode_batch(texts))
    dt = time.perf_counter() - tic
    return {"case": "tokenizer only (encode_batch)", "tokens": n, "seconds": dt}


def pipeline_case(path: Path, workers: int, workdir: Path, tokenizer_dir: str) -> dict:
    from data_prep.pipeline import prepare_data
    from difflm.config import load_config

    cfg = load_config(
        "tiny-cpu",
        [
            f"workdir={workdir}",
            f"data.sources=[{path}]",
            f"data.workers={workers}",
            f"tokenizer.path={tokenizer_dir}",
            "tracking.enabled=false",
        ],
    )
    tic = time.perf_counter()
    m = prepare_data(cfg)
    dt = time.perf_counter() - tic
    n = sum(s["tokens"] for s in m["splits"].values())
    return {"case": f"datatrove pipeline, {workers} worker(s)", "tokens": n, "seconds": dt}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # kind path arg workdir
    args = p.parse_args()
    if args.one:
        kind, path, arg, workdir = args.one
        if kind == "ceiling":
            row = tokenizer_ceiling(Path(path), arg)
        else:
            row = pipeline_case(Path(path), int(kind), Path(workdir), arg)
        row["peak_mb"] = (
            max(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
            )
            / 1024
        )
        print(json.dumps(row))
        return 0

    from data_prep.pipeline import prepare_data
    from difflm.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # the demo tokenizer (trained once, not timed)
        tok_dir = prepare_data(load_config("tiny-cpu", [f"workdir={tmp / 'tok'}"]))["tokenizer"]["path"]
        path = corpus(args.repeat, tmp)
        cases = [("ceiling", str(Path(tok_dir) / "tokenizer.json"))] + [(str(w), tok_dir) for w in args.workers]
        rows = []
        for kind, arg in cases:
            cmd = [sys.executable, __file__, "--one", kind, str(path), arg, str(tmp / f"w{kind}")]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        mb = path.stat().st_size / 2**20
    print(f"\ndata prep on the demo corpus x{args.repeat} ({mb:.1f} MB of JSONL), {os.cpu_count()} CPU cores")
    print(f"{'case':<36}{'tokens':>12}{'seconds':>10}{'tokens/s':>12}{'peak MB':>10}{'of ceiling':>12}")
    ceiling = rows[0]["tokens"] / rows[0]["seconds"]
    for r in rows:
        rate = r["tokens"] / r["seconds"]
        print(
            f"{r['case']:<36}{r['tokens']:>12,}{r['seconds']:>10.2f}{rate:>12,.0f}{r['peak_mb']:>10.0f}"
            f"{rate / ceiling:>11.0%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
