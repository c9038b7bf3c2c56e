"""Every size of the GPU check in one place (the GPU figures, or a tiny CPU run of the same code: `--dry-run`), and
the run configurations the sections build, in the config tree's current keys.

Micro-batch jobs (benchmarks/gpu/microbatch.py), one per section that times the harness:
- shapes: (seq, micro-batch) rows; `sweep`: in increasing size until one does not fit (a row's error ends it)
- modes: the first is measured at every shape; the others (`baseline`) at the largest shape that fitted
- documents: model.document_attention (FLOPs from the documents' real pairs)
- profile: "best" (one profiled step at the largest fitting shape) or "each" (after every row)
- repeat: the largest fitting row measured once more (run-to-run spread)
"""

from __future__ import annotations

from pathlib import Path


def _knobs(base: list[int], selective: list[int], full: list[int], small: tuple[str, list[int]], dry: bool = False):
    """The MFU levers of the config (model.compile, model.recompute, model.cuda_graphs), each a row beside `off`
    at its shape; CUDA graphs on the small model (preset, shape), where launch overhead shows, beside its own off.
    The dry run leaves out the whole-layer compile (a minute of Inductor on the CPU) and the CUDA graphs (refused
    without CUDA); their unit tests cover them."""
    preset, shape = small
    knobs = [
        {"name": "off", "shape": base},
        {"name": "compile=rope", "shape": base, "model": {"compile": "rope"}},
        {"name": "compile=layers", "shape": base, "model": {"compile": "layers"}},
        {"name": "recompute=selective", "shape": selective, "model": {"recompute": "selective"}},
        {"name": "recompute=full", "shape": full, "model": {"recompute": "full"}},
        {"name": f"off, {preset}", "shape": shape, "preset": preset},
        {"name": f"cuda_graphs=layers, {preset}", "shape": shape, "preset": preset, "model": {"cuda_graphs": "layers"}},
    ]
    return [k for k in knobs if not (dry and k["name"].startswith(("compile=layers", "cuda_graphs")))]


def _jobs(dry: bool) -> dict:
    if dry:
        return {
            "microbatch-1b": {"preset": "tiny", "shapes": [[64, 1], [64, 2]], "modes": ["difflm-noshift", "ar"],
                              "sweep": True, "profile": "best", "repeat": True},
            "long-context": {"preset": "tiny", "shapes": [[128, 2], [256, 1]], "modes": ["difflm-noshift", "ar"],
                             "documents": True, "baseline_each": True},
            "profile-350m": {"preset": "tiny", "shapes": [[64, 1], [64, 2]], "modes": ["difflm-noshift"],
                             "profile": "each"},
            "mfu-knobs": {"preset": "tiny", "modes": ["difflm-noshift"], "knobs": _knobs([64, 2], [64, 2], [64, 2], ("tiny", [64, 2]), dry=True)},
        }  # fmt: skip
    return {
        # measured on an H200: 24 fits (111 GB with the fused kernels), 32 would not
        "microbatch-1b": {"preset": "1b", "shapes": [[2048, m] for m in (8, 12, 16, 24)],
                          "modes": ["difflm-noshift", "ar"], "sweep": True, "profile": "best", "repeat": True},
        # tokens per step as the 2048 x 24 row (49k); documents of 128-4000 tokens packed
        "long-context": {"preset": "1b", "shapes": [[4096, 12], [8192, 6]], "modes": ["difflm-noshift", "ar"],
                         "documents": True, "baseline_each": True},
        # the 350M at 0.28 MFU in the trainer: is its missing quarter host overhead? (kernel time vs step)
        "profile-350m": {"preset": "350m", "shapes": [[2048, 8], [2048, 32]], "modes": ["difflm-noshift"],
                         "profile": "each"},
        # each lever against off at micro-batch 24; recompute where it is for: micro-batches that do not fit without
        "mfu-knobs": {"preset": "1b", "modes": ["difflm-noshift"], "knobs": _knobs([2048, 24], [2048, 32], [2048, 48], ("350m", [2048, 8]))},
    }  # fmt: skip


def plan(dry: bool) -> dict:
    """The check's sizes: the GPU run's, or the dry run's on the CPU."""
    common = {"dry": dry, "precision": "bf16", "parity_mbs": 2, "jobs": _jobs(dry)}
    if dry:
        return {
            **common,
            "vocab": 512,
            "documents": 400,
            "doc_len": [8, 64],  # document lengths drawn uniformly in this range: several per window
            "small": "tiny",
            "seq": 64,
            "mbs": 2,
            "steps": 6,
            "block_steps": 4,
            "block_seq": 64,
            "big": "tiny",
            "big_seq": 64,
            "timed_steps": 2,
            "sample_len": 16,
            "timeout": 300,
            "probe_mbs": 2,
            "probe_iters": 2,
            "probe_matmul": 256,
            "probe_copy_mb": 8,
            "decode": {"random": "tiny", "vocab": 64, "documents": 120, "doc_len": [16, 64], "dominant": 0.9,
                       "preset": "tiny", "seq": 64, "steps": 4, "mbs": 2, "lr": 3e-3, "block_size": 4,
                       "prompt_len": 8, "new_tokens": 8, "batches": [1, 4], "batch1_prompts": 2},
        }  # fmt: skip
    return {
        **common,
        "vocab": 32768,
        "documents": 3000,
        "doc_len": [128, 4000],  # 8192 tokens hold 2-60 documents: document masks at long context
        "small": "350m",
        "seq": 2048,
        "mbs": 8,
        "steps": 150,
        "block_steps": 60,
        "block_seq": 1024,
        "big": "1b",
        "big_seq": 2048,
        "timed_steps": 10,
        "sample_len": 128,
        "timeout": 420,
        "probe_mbs": 16,
        "probe_iters": 5,
        "probe_matmul": 8192,
        "probe_copy_mb": 1024,
        # decoding: random SmolLM2-135M-shaped models (a call's cost at that size); confident models of the small
        # preset trained on a 0.9-dominant chain over a small vocabulary (1,024 ids: each successor seen ~100s of
        # times in 300 steps), so threshold decoding has probabilities above 0.25 to act on
        "decode": {"random": "smollm2-135m", "vocab": 1024, "documents": 2000, "doc_len": [128, 1024],
                   "dominant": 0.9, "preset": "small", "seq": 256, "steps": 300, "mbs": 16, "lr": 1e-3,
                   "block_size": 8, "prompt_len": 64, "new_tokens": 64, "batches": [1, 16], "batch1_prompts": 4},
    }  # fmt: skip


def config(p: dict, workdir: Path, preset: str, seq: int, mode: str, *, steps: int | None = None, **sections):
    """A validated run config. `sections`: overrides by section, e.g. train={"micro_batch_size": 8},
    model={"document_attention": True}, diffusion={"block_size": 4}."""
    # lazy: pydantic comes from the wheels, installed after this module is imported (benchmarks/gpu/runtime.py)
    from difflm.config import validate

    steps = steps or p["steps"]
    train = sections.pop("train", {})
    t = {
        "seq_length": seq,
        "micro_batch_size": p["mbs"],
        "global_batch_size": p["mbs"],
        "train_iters": steps,
        "optimizer": {"lr": 3e-4 if preset != "tiny" else 3e-3, **train.pop("optimizer", {})},
        "schedule": {"min_lr": 3e-5, "warmup_iters": max(1, steps // 10), **train.pop("schedule", {})},
        "log_interval": max(1, steps // 12),
        "eval_interval": steps,
        "eval_iters": 2,
        "precision": p["precision"],
        **train,
    }
    return validate(
        {
            "name": f"gpu-check-{preset}",
            "workdir": str(workdir),
            "model": {"preset": preset, "backend": "auto", **sections.pop("model", {})},
            "diffusion": {"model_running_mode": mode, **sections.pop("diffusion", {})},
            "train": t,
            "checkpoint": {"save_interval": steps, "keep_last": 1},
            **sections,
        }
    )
