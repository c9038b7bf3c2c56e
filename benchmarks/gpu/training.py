"""Sections that run the trainer itself (`python -m difflm.models.megatron.train` under torchrun, as a real run does):
train-difflm, train-ar and train-block (block diffusion through the FlexAttention block mask, then with
complementary masks); and the `gpu` pytest tier (tests/gpu/) as sections.

The trainer logs tokens/s, TFLOP/s and MFU from its objective's own FLOPs count (block diffusion: the pairs its
block mask allows; complementary masks: both copies), so these sections read its metrics.jsonl.
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.gpu.plan import config
from benchmarks.gpu.runtime import ROOT, _tail, read_jsonl, run_logged, torchrun

# `gpu` tests that compile FlexAttention (packed documents, block masks on CUDA): a section of their own, last
FLEX_TESTS = "documents or docs or flex or thd or block"
GPU_TEST_FILES = ("tests/gpu/test_gpu.py", "tests/unit/models/hf/test_hf_device.py")


def gpu_tests(check, name: str, selection: str) -> dict:
    """The `gpu`-marked tests of `selection` (-k), their output in NAME.log as it comes."""
    files = [f for f in GPU_TEST_FILES if (ROOT / f).exists()]
    log = check.out / f"{name}.log"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-k", selection, "-q", "-p", "no:cacheprovider", *files]
    code = run_logged(cmd, log, check.timeout())
    summary = (log.read_text(errors="replace").strip().splitlines() or [""])[-1]
    if code not in (0, 5):  # 5: nothing selected
        raise RuntimeError(f"gpu tests failed: {summary}\n{_tail(log, 60)}")
    return {"summary": summary, "selection": selection}


def train_summary(cfg, run_dir: Path, rows: list[dict]) -> dict:
    logged = [r for r in rows if r.get("loss") is not None]
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    steady = logged[1:] or logged  # the first interval includes compilation and warm-up

    def mean(key):
        have = [r[key] for r in steady if r.get(key) is not None]
        return sum(have) / len(have) if have else None

    d = cfg.diffusion
    return {
        "mode": d.model_running_mode,
        "preset": cfg.model.preset,
        "seq": cfg.train.seq_length,
        "micro_batch": cfg.train.micro_batch_size,
        "block_size": getattr(d, "block_size", None),
        "complementary_masks": getattr(d, "complementary_masks", None),
        "steps": cfg.train.train_iters,
        "steps_logged": logged[-1].get("iteration", logged[-1].get("step")) if logged else None,
        "loss_first": logged[0]["loss"] if logged else None,
        "loss_last": logged[-1]["loss"] if logged else None,
        "val_first": vals[0] if vals else None,
        "val_last": vals[-1] if vals else None,
        "loss_falling": bool(logged) and logged[-1]["loss"] < logged[0]["loss"],
        "tokens_per_s_per_device": mean("tokens_per_s_per_device"),
        "tflops_per_device": mean("tflops_per_device"),
        "mfu": mean("mfu"),
        "peak_memory_gb": max((r.get("peak_memory_gb") or 0) for r in rows) or None if rows else None,
        "run_dir": str(run_dir),
    }


def train(check, name: str, manifest: Path, mode: str, tag: str | None = None, **over) -> dict:
    """The small preset (or `preset` in `over`) trained by the trainer; `tag` names its files (default: the mode),
    `over`: config() arguments (seq, steps, sections)."""
    # lazy: pydantic comes from the wheels (benchmarks/gpu/runtime.py); the environment section installed them
    from difflm.config import save_config

    p, out = check.p, check.out
    tag = tag or mode
    cfg = config(p, out / "work", over.pop("preset", p["small"]), over.pop("seq", p["seq"]), mode, **over)
    run_dir = out / f"run-{tag}"
    cfg_path = save_config(cfg, out / f"config-{tag}.yaml")
    metrics = run_dir / "metrics.jsonl"
    cmd = ["-m", "difflm.models.megatron.train", "--config", str(cfg_path), "--manifest", str(manifest)]
    torchrun(
        [*cmd, "--run-dir", str(run_dir)],
        out / f"train-{tag}.log",
        check.timeout(),
        check.rows(name, metrics, lambda rows: train_summary(cfg, run_dir, rows)),
    )
    return train_summary(cfg, run_dir, read_jsonl(metrics))


def train_block(check, manifest: Path) -> dict:
    """Block diffusion (block 4) through the block mask (FlexAttention on CUDA), then the same with complementary
    masks (twice the rows per sequence, half the steps): whether the loss falls, MFU from the mask's pairs,
    memory."""
    p = check.p
    steps = p["block_steps"]
    seq = p["block_seq"]
    block = {"diffusion": {"block_size": 4}}
    runs = {
        "block": train(check, "train-block", manifest, "difflm-block", "block", seq=seq, steps=steps, **block),
        "complementary": train(
            check,
            "train-block",
            manifest,
            "difflm-block",
            "block-complementary",
            seq=seq,
            steps=max(2, steps // 2),
            diffusion={"block_size": 4, "complementary_masks": True},
        ),
    }
    return runs
