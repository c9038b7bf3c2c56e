"""The micro-batch harness's figures from its rows (pure Python: the main process and the unit tests read them
without torch or megatron): spread of timed steps, MFU without the optimizer step, device busy share, kernel
categories, the sweep's summary (also of a run cut short).

MFU conventions: `mfu` counts bidirectional attention over all s^2 pairs and causal over half (the model's work;
models/megatron/flops.py); `mfu_megatron` is Megatron-LM's `num_floating_point_operations`, which always halves
attention (it assumes causal), so a bidirectional model reads lower there. Quote both.
"""

from __future__ import annotations

import statistics

GOAL_MFU_1B = 0.45


def spread(seconds: list[float]) -> dict:
    """Median, min and max of per-step seconds."""
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds), "n": len(seconds)}


def memory_error(exc: BaseException) -> bool:
    """An allocation failure at the memory edge: torch's OOM, or cuBLAS / cuDNN / NCCL failing to allocate
    (those come as a plain RuntimeError)."""
    text = str(exc)
    return type(exc).__name__ == "OutOfMemoryError" or any(
        s in text for s in ("out of memory", "ALLOC_FAILED", "cudaErrorMemoryAllocation", "CUBLAS_STATUS_ALLOC")
    )


def kernel_category(name: str) -> str:
    """GEMM / attention / optimizer / communication / elementwise of a CUDA kernel (or, on the CPU, an aten op)."""
    n = name.lower()
    if "nccl" in n or "c10d::" in n:
        return "communication"
    if any(t in n for t in ("flash", "fmha", "sdpa", "attention", "flex", "attn")):
        return "attention"
    if any(t in n for t in ("multi_tensor", "adam", "_foreach")):
        return "optimizer"
    if any(t in n for t in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm")):
        return "gemm"
    return "elementwise"


def busy_share(kernel_ms: float, step_s: float | None) -> float | None:
    """Device kernel time over the UNPROFILED step's wall time: the profiler's own overhead (about 130 ms on a
    1B step) would otherwise read as idle device time."""
    return round(kernel_ms / (1e3 * step_s), 3) if step_s else None


def without_optimizer(row: dict) -> float | None:
    """MFU of forward+backward alone, from the same unprofiled steps (the median forward+backward time, synchronised
    before the optimizer): what a run accumulating several micro-batches per optimizer step approaches."""
    if row.get("mfu") is None or not row.get("forward_backward_s"):
        return None
    return row["mfu"] * row["step_s"] / row["forward_backward_s"]


def summary(job: str, p: dict, rows: list[dict]) -> dict:
    """A job's figures from its rows: the rows themselves, profiles and kernels apart; the headline (the largest
    fitting row of the first mode), its repeat, and the baseline at the same shape."""
    spec = p.get("jobs", {}).get(job, {})
    profiles = [r["profile"] for r in rows if "profile" in r]
    kernels = next((r["kernels"] for r in rows if "kernels" in r), None)
    rows = [r for r in rows if "profile" not in r and "kernels" not in r]
    measured = [r for r in rows if "step_s" in r and not r.get("repeat")]
    first = (spec.get("modes") or [measured[0]["mode"] if measured else None])[0]
    best = next((r for r in reversed(measured) if r["mode"] == first), None)
    same = [r for r in measured if best and r["mode"] != first and r["seq"] == best["seq"]]
    base = next((r for r in same if r["micro_batch"] == best["micro_batch"]), None)
    repeat = next((r for r in rows if r.get("repeat") and "step_s" in r), None)
    both = best and base
    return {
        "preset": spec.get("preset"),
        "rows": rows,
        "largest_micro_batch": best and best["micro_batch"],
        "seq": best and best["seq"],
        "mfu": best and best["mfu"],
        "mfu_megatron": best and best.get("mfu_megatron"),
        "repeat_mfu": repeat and repeat["mfu"],
        "baseline_mfu": base and base["mfu"],
        "baseline_mode": base and base["mode"],
        "tokens_per_s": best and best.get("tokens_per_s"),
        "peak_memory_gb": best and best.get("peak_memory_gb"),
        # bidirectional attention does twice the attention FLOPs of causal: compare throughput in FLOPs
        "over_baseline_tflops": best["tflops"] / base["tflops"] if both and base["tflops"] else None,
        "over_baseline_step_time": best["step_s"] / base["step_s"] if both else None,
        # the harness pays the optimizer every micro-batch (global batch = micro-batch); real runs accumulate
        "mfu_without_optimizer": without_optimizer(best) if best else None,
        "profiles": profiles,
        "kernels": kernels,
    }
