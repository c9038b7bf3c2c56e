"""One-shot GPU check: everything that needs a GPU, in one run, with a markdown + JSON report.

    python benchmarks/gpu_check.py REPORT_DIR                      # on one H100/H200-class GPU
    python benchmarks/gpu_check.py REPORT_DIR --dry-run            # the same code path on the CPU at a tiny size
    python benchmarks/gpu_check.py REPORT_DIR --only long-context  # some sections (environment and data always run)
    bash benchmarks/gpu_run.sh                                     # the command for the GPU machine (docs/gpu-check.md)

It runs in a bare, offline CUDA environment that has only Python, PyTorch, transformers, safetensors,
tokenizers, numpy, pyyaml, psutil and pytest: megatron-core and pydantic (and typing-extensions / psutil where
the image's are missing or too old) are installed from the wheels that `benchmarks/gpu_wheels.py` downloads
beforehand into `benchmarks/gpu_wheels/` (benchmarks/gpu/runtime.py). It imports only the trainer and the HF
export (no Prefect, MLflow or datatrove) and makes its own data (benchmarks/gpu/corpus.py).

SECTIONS below is the one table of sections, in run order (the most valuable figures first; a timeout cuts only
the last), each with the budget it needs to start and its own time cap. Each is timed and reported even when
another fails; report.json and report.md are rewritten at the start and end of every section and whenever a
worker writes a row; each section prints one JSON line on stdout ({"section": ..., "status": ..., "seconds": ...,
"result": ...}), each measured row one more ({"section": ..., "row": ...}). The test suite runs `--dry-run` in an
environment built like the GPU image, so this script cannot rot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script: the repository's packages (benchmarks.gpu, models, difflm)
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu import decode, training  # noqa: E402
from benchmarks.gpu import export as export_checks  # noqa: E402
from benchmarks.gpu.corpus import make_dataset  # noqa: E402
from benchmarks.gpu.plan import plan  # noqa: E402
from benchmarks.gpu.probe import environment, probe  # noqa: E402
from benchmarks.gpu.report import Check  # noqa: E402
from benchmarks.gpu.runtime import Interrupted, ensure_dependencies, offline_environment, worker  # noqa: E402


@dataclass(frozen=True)
class Section:
    name: str
    run: Callable  # (check, state) -> result
    need_s: float  # budget left it needs to start
    cap_s: float  # its own time cap on the GPU (a child's timeout: this, cut to the budget left)
    about: str
    needs: str | None = None  # a state key an earlier section leaves (its result), else skipped


def _environment(check: Check, state: dict):
    cache = state["args"].site_cache
    installed = ensure_dependencies(Path(state["args"].wheels), check.out / ".site", Path(cache) if cache else None)
    import torch  # after the install: torch is in the image, but its import pulls in nothing of ours

    if not torch.cuda.is_available() and not check.p["dry"]:
        raise SystemExit("no CUDA device: use --dry-run to exercise the check on the CPU")
    check.report["environment"] = environment(installed)
    return check.report["environment"]


def _data(check: Check, state: dict):
    return {"tokens": make_dataset(check.p, check.out / "data").unique_tokens}


def _job(name: str, kind: str = "microbatch"):
    def run(check: Check, state: dict):
        return worker(check, kind, state["manifest"], name=name, job=name, tag=name)

    return run


def _train(name: str, mode: str):
    def run(check: Check, state: dict):
        state[mode] = training.train(check, name, state["manifest"], mode)
        return state[mode]

    return run


def _export(check: Check, state: dict):
    return export_checks.export(check, state["manifest"], state["difflm-noshift"])


def _tests(name: str, selection: str):
    return lambda check, state: training.gpu_tests(check, name, selection)


FLEX = training.FLEX_TESTS
SECTIONS: tuple[Section, ...] = (
    Section("environment", _environment, 0, 60, "versions, device, what came from the wheels"),
    Section("probe", lambda c, s: probe(c.p), 5, 60, "collectives, SDPA backend per layout, matmul/copy ceilings"),
    Section("data", _data, 0, 60, "the Markov corpus, documents of varied lengths"),
    Section("microbatch-1b", _job("microbatch-1b"), 45, 150, "1B seq 2048: micro-batch sweep, profile, repeat, AR"),
    Section("train-difflm", _train("train-difflm", "difflm-noshift"), 45, 120, "350M, 150 trainer steps"),
    Section("export", _export, 30, 90, "HF export vs megatron logits, fp32 and bf16", needs="difflm-noshift"),
    Section("spec-parity", lambda c, s: worker(c, "parity", s["manifest"], name="spec-parity"), 25, 90,
            "torch spec vs local spec, first-step loss"),
    Section("gpu-tests", _tests("gpu-tests", f"not ({FLEX})"), 30, 120, "the gpu tier without compiles"),
    Section("train-ar", _train("train-ar", "ar"), 45, 120, "the AR baseline, 150 trainer steps"),
    Section("gpu-tests-flex", _tests("gpu-tests-flex", FLEX), 30, 200, "FlexAttention tests: documents, block mask"),
    Section("train-block", lambda c, s: training.train_block(c, s["manifest"]), 30, 120,
            "350M difflm-block through the block mask, then complementary masks"),
    Section("profile-350m", _job("profile-350m"), 30, 60, "350M profiled at micro-batch 8 and 32"),
    Section("long-context", _job("long-context"), 45, 120, "1B difflm vs AR, document masks, seq 4096 and 8192"),
    Section("mfu-knobs", _job("mfu-knobs", "knobs"), 45, 150,
            "1B: compiled RoPE / layers, recompute, vs off; CUDA graphs on the 350M"),
    Section("decode", decode.section, 45, 100,
            "decoders' tokens/s, calls/token, memory: random 135M-shaped and confident trained models"),
)  # fmt: skip
ALWAYS = {"environment", "data"}  # every other section needs the packages; the training ones need the data
NAMES = tuple(s.name for s in SECTIONS)


def run_sections(check: Check, args) -> None:
    state: dict = {"args": args, "manifest": check.out / "data" / "manifest.json"}
    for s in SECTIONS:
        wanted = not check.only or s.name in check.only
        if s.needs and wanted and not state.get(s.needs):
            check.skip(s.name, f"skipped: no {s.needs} result from an earlier section")
            continue
        result = check.section(s.name, lambda s=s: s.run(check, state), s.need_s, s.cap_s)
        if result is None and s.name in ALWAYS:
            return  # nothing else can run without the packages and the data


def _sections(text: str) -> set[str]:
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(NAMES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    return names


def _forced_sdpa(name: str | None):
    """sdpa_kernel([BACKEND]) around a worker (--sdpa / DIFFLM_SDPA_BACKEND), else nothing."""
    if not name:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name.upper())])


def _workers() -> dict:
    # lazy: a worker runs after the wheels' install; the microbatch module imports megatron at its top
    from benchmarks.gpu import microbatch

    return {
        "logits": export_checks.worker_logits,
        "parity": export_checks.worker_parity,
        "microbatch": microbatch.worker_microbatch,
        "knobs": microbatch.worker_knobs,
        "decode": decode.worker_decode,
    }


def _interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="report folder (report.md, report.json, logs)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: the same code path, a few minutes")
    ap.add_argument("--wheels", default=str(HERE / "gpu_wheels"), help="folder of wheels for missing packages")
    ap.add_argument(
        "--site-cache",
        help="install the wheels once into this folder (a subfolder per set of wheels) and reuse it; default: into "
        "the report's .site each run (the GPU machine's one run)",
    )
    ap.add_argument("--budget-s", type=float, default=450, help="skip sections that would not fit in this many seconds")
    ap.add_argument(
        "--sdpa",
        default=os.environ.get("DIFFLM_SDPA_BACKEND") or None,
        choices=["flash_attention", "cudnn_attention", "efficient_attention", "math"],
        help="force this SDPA backend in the micro-batch and parity workers (default: PyTorch's choice)",
    )
    ap.add_argument(
        "--only",
        type=_sections,
        help="run only these sections (comma-separated; environment and data always run), e.g. "
        "gpu-tests-flex,train-block for a second device call. Sections: " + ", ".join(NAMES),
    )
    ap.add_argument("--worker", choices=["logits", "parity", "microbatch", "knobs", "decode"], help=argparse.SUPPRESS)
    for hidden in ("--manifest", "--result", "--checkpoint", "--config", "--rows", "--job", "--models"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # inside torchrun
        with _forced_sdpa(args.sdpa):
            result = _workers()[args.worker](args, plan(args.dry_run))
        if int(os.environ.get("RANK", 0)) == 0:
            Path(args.result).write_text(json.dumps(result, indent=1, default=str))
        return 0
    if not args.out:
        ap.error("give the report folder")
    offline_environment()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    p = plan(args.dry_run)
    meta = {"dry_run": args.dry_run, "sdpa_forced": args.sdpa, "argv": sys.argv[1:]}
    check = Check(out, p, args.budget_s if not args.dry_run else float("inf"), meta, args.only, ALWAYS)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupt)
    code = 0
    try:
        run_sections(check, args)
    except Interrupted as exc:
        check.report["interrupted"] = str(exc)
        code = 143
    check.write()
    failed = [n for n, s in check.sections.items() if s["status"] in ("failed", "killed", "timeout")]
    check.emit({"report": str(out / "report.md"), "seconds": round(check.report["seconds"], 1), "failed": failed})
    return code or (1 if failed else 0)


if __name__ == "__main__":  # dist_checkpointing spawns helpers: the guard is required
    sys.exit(main())
