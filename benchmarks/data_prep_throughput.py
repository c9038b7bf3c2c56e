"""Data-prep throughput, side by side in one run on the same corpus: the tokenizer alone (the ceiling), the
datatrove pipeline with 1 and 2 workers, Megatron-LM's `tools/preprocess_data.py` (or why it was skipped),
and the input bytes each task reads for 1, 2, 4 and 8 tasks (a count: exact on any machine).

    .venv/bin/python benchmarks/data_prep_throughput.py [--repeat 16] [--workers 1 2] [--megatron-lm DIR]

The corpus is the demo corpus repeated (with a counter so that no document is a duplicate) to make the run
long enough to measure. Each timed case runs in a fresh process so peak RSS is its own (children included).
Megatron-LM: neither megatron-core's wheel nor its sdist ships `tools/preprocess_data.py` (it is in the
Megatron-LM repository only), so it runs from a checkout given as `--megatron-lm DIR` (e.g. `git clone -b
core_v0.16.1 https://github.com/NVIDIA/Megatron-LM`), else the row says why it was skipped. The script imports
`megatron.training`, which imports Triton: when this environment lacks it, the benchmark installs it (no
dependencies, it is only imported) into a folder of its own, ~/.cache/difflm/megatron-tools, put on the
script's path alone; this environment is left as it was.
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
    from difflm.data_prep.corpus import demo_corpus

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
    n = sum(len(e.ids) + 1 for e in tok.encode_batch_fast(texts))
    dt = time.perf_counter() - tic
    return {"case": "tokenizer alone (encode_batch_fast)", "tokens": n, "seconds": dt}


def pipeline_case(path: Path, workers: int, workdir: Path, tokenizer_dir: str) -> dict:
    from difflm.config import load_config
    from difflm.data_prep.pipeline import prepare_data

    cfg = load_config(
        "tiny-cpu",
        [
            f"workdir={workdir}",
            f"data.sources=[{path}]",
            f"data.workers={workers}",
            f"tokenizer.path={tokenizer_dir}",
            "tracking.enabled=false",
            "data.max_documents=null",  # each task reads its share of the input (dedup and a count read all)
            "data.dedup=false",
            "data.min_chars=0",
        ],
    )
    tic = time.perf_counter()
    m = prepare_data(cfg)
    dt = time.perf_counter() - tic
    n = sum(s.tokens for s in m.splits.values())
    return {"case": f"datatrove pipeline, {workers} worker(s)", "tokens": n, "seconds": dt}


def megatron_case(path: Path, workers: int, checkout: str | None, tokenizer_dir: str, out: Path) -> dict:
    """Megatron-LM's preprocess_data.py on the same corpus and tokenizer (EOS appended, as ours), or why not."""
    case = f"Megatron-LM preprocess_data.py, {workers} worker(s)"
    if not checkout:
        return {"case": case, "skipped": "megatron-core's wheel ships no tools/preprocess_data.py: pass --megatron-lm"}
    script = Path(checkout) / "tools" / "preprocess_data.py"
    cmd = [sys.executable, str(script), "--input", str(path), "--output-prefix", str(out / "megatron")]
    cmd += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir]
    cmd += ["--workers", str(workers), "--append-eod"]
    try:
        extra = triton_folder()
    except RuntimeError as err:
        return {"case": case, "skipped": str(err)}
    path_ = os.pathsep.join([checkout, *([str(extra)] if extra else [])])
    env = {**os.environ, "PYTHONPATH": path_, "PYTHONWARNINGS": "ignore"}
    out.mkdir(parents=True, exist_ok=True)
    tic = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=checkout)
    dt = time.perf_counter() - tic
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"case": case, "skipped": f"it failed here: {last}"}
    from difflm.data_prep.verify import read_index  # the prep's own .idx reader (no megatron import, no memory map)

    (idx,) = out.glob("*.idx")
    _, lengths, _, _ = read_index(idx)
    n = int(lengths.sum())
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # this process runs one case only
    return {"case": case, "tokens": n, "seconds": dt, "peak_mb": peak}


TOOLS = Path.home() / ".cache" / "difflm" / "megatron-tools"


def triton_folder() -> Path | None:
    """None when Triton imports here; else a folder holding it (installed once, without its dependencies:
    Megatron-LM's training package only imports it), for the Megatron-LM script's path alone."""
    if subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode == 0:
        return None
    if not (TOOLS / "triton").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TOOLS), "triton"]
        proc = subprocess.run(pip, capture_output=True, text=True)
        if proc.returncode:
            why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"Triton, which its megatron.training imports, did not install ({why})")
    return TOOLS


def bytes_read_per_task(path: Path, counts=(1, 2, 4, 8)) -> dict[int, list[int]]:
    """The input bytes each task's reader reads (its `read_bytes` stat), for each number of tasks."""
    from difflm.data_prep.readers import make_reader

    result = {}
    for n in counts:
        per_task = []
        for rank in range(n):
            reader = make_reader(path, "jsonl", "text", "bench")
            reader.quiet = True
            for _ in reader.run(None, rank, n):
                pass
            per_task.append(reader.stats["read_bytes"].total)
        result[n] = per_task
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=16, help="copies of the demo corpus (16: 43 MB, 12.7M tokens)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--megatron-lm", help="a Megatron-LM checkout whose tools/preprocess_data.py to run")
    p.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # kind path arg workdir
    args = p.parse_args()
    if args.one:
        kind, path, arg, workdir = args.one
        if kind == "ceiling":
            row = tokenizer_ceiling(Path(path), arg)
        elif kind.startswith("megatron"):  # arg: the checkout; workdir: the tokenizer
            row = megatron_case(
                Path(path), int(kind.split(":")[1]), arg, workdir, Path(path).parent / kind.replace(":", "-")
            )
            print(json.dumps(row))
            return 0
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

    from difflm.config import load_config
    from difflm.data_prep.pipeline import prepare_data

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # the demo tokenizer (trained once, not timed)
        tok_dir = prepare_data(load_config("tiny-cpu", [f"workdir={tmp / 'tok'}"])).tokenizer.path
        path = corpus(args.repeat, tmp)
        cases = [("ceiling", str(Path(tok_dir) / "tokenizer.json"), "")]
        cases += [(str(w), tok_dir, str(tmp / f"w{w}")) for w in args.workers]
        if args.megatron_lm:  # each in a process of its own, as the others: its peak RSS is its own
            cases += [(f"megatron:{w}", args.megatron_lm, tok_dir) for w in args.workers]
        rows = []
        for kind, arg, workdir in cases:
            cmd = [sys.executable, __file__, "--one", kind, str(path), arg, workdir or str(tmp / "w")]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if out.returncode:
                print(out.stdout[-2000:] + out.stderr[-3000:], file=sys.stderr)
                print(f"the case {kind!r} failed (exit {out.returncode}): its output is above", file=sys.stderr)
                return 1
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if not args.megatron_lm:
            rows += [megatron_case(path, w, None, tok_dir, tmp) for w in args.workers]  # the reason it is skipped
        reads = bytes_read_per_task(path)
        size = path.stat().st_size
        mb = size / 2**20
    print(f"\ndata prep on the demo corpus x{args.repeat} ({mb:.1f} MB of JSONL), {os.cpu_count()} CPU cores")
    print(f"{'case':<36}{'tokens':>12}{'seconds':>10}{'tokens/s':>12}{'peak MB':>10}{'of ceiling':>12}")
    ceiling = rows[0]["tokens"] / rows[0]["seconds"]
    for r in rows:
        if "skipped" in r:
            print(f"{r['case']:<36} skipped: {r['skipped']}")
            continue
        rate = r["tokens"] / r["seconds"]
        print(
            f"{r['case']:<36}{r['tokens']:>12,}{r['seconds']:>10.2f}{rate:>12,.0f}{r['peak_mb']:>10.0f}"
            f"{rate / ceiling:>11.0%}"
        )
    print(f"\ninput bytes read per task ({size:,} bytes in all)")
    for n, per_task in reads.items():
        print(f"{n} task(s): max {max(per_task):,} ({max(per_task) / size:.1%}), sum {sum(per_task):,}: {per_task}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
