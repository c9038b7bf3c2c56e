"""The micro-batch harness (one torchrun worker per job of plan's `jobs`): a model built as the trainer builds it
(its kernels, fused AdamW, compiled SwiGLU), timed over `timed_steps` unprofiled steps at each (seq, micro-batch)
shape, each row written as soon as it is measured; profiled steps by kernel category.

Counting: with model.document_attention the FLOPs count the (query, key) pairs within the documents the timed
steps really trained on (not s^2); every timed step is synchronised before and after its optimizer step, so the
forward+backward time and the MFU without the optimizer come from the same unprofiled pace; a profile's device
busy share is its kernel time over the unprofiled median step.

Runs only in the worker process, after the wheels' install: megatron and the trainer are imported at module level.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu.figures import busy_share, kernel_category, memory_error, spread, summary
from benchmarks.gpu.plan import config
from difflm.manifest import DataManifest
from difflm.models.diffusion.modes import build_objective, objective_class
from difflm.models.megatron import flops
from difflm.models.megatron.data import build_datasets
from difflm.models.megatron.forward_step import SpecialTokens
from difflm.models.megatron.kernels import kernel_settings, sdpa_choice
from difflm.models.megatron.train import build_training, init_distributed, run_global_batch

TOP_KERNELS = 20


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def append_row(args, row: dict) -> None:
    """A measured row, at once: a line in the rows file (the main process puts it in the report) and stdout."""
    line = json.dumps(row, default=str)
    print(line, flush=True)
    if getattr(args, "rows", None):
        with open(args.rows, "a") as f:
            f.write(line + "\n")


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def timed_steps(cfg, ddp, opt, dataset, special, steps: int, warmup: int = 1) -> dict:
    """Per-step seconds (forward, backward, optimizer) and forward+backward seconds of `steps` steps after `warmup`,
    and each step's document pairs when cfg.model.document_attention is on."""
    pairs: list[float] | None = [] if cfg.model.document_attention else None
    objective = build_objective(cfg.diffusion, special.ids())
    step_s, fwd_bwd_s = [], []
    for i in range(warmup + steps):
        timed = i >= warmup
        seen = pairs if timed else None  # document pairs of the timed steps only
        ddp.zero_grad_buffer()
        opt.zero_grad()
        sync()
        t0 = time.perf_counter()
        run_global_batch(cfg, ddp, dataset, special, step=i, noise_step=i, attention_pairs=seen, objective=objective)
        sync()
        t1 = time.perf_counter()
        opt.step()
        sync()
        if timed:
            step_s.append(time.perf_counter() - t0)
            fwd_bwd_s.append(t1 - t0)
    return {"step_s": step_s, "forward_backward_s": fwd_bwd_s, "pairs": pairs}


def profiled_step(cfg, ddp, opt, dataset, special, it: int, step_s: float | None) -> dict:
    """One training step under torch.profiler: device time by kernel category (on the CPU, aten self time), the
    forward+backward and optimizer wall times (synchronised), the heaviest kernels and the heaviest elementwise
    ones by name; busy share against the unprofiled step `step_s`."""
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    objective = build_objective(cfg.diffusion, special.ids())
    with profile(activities=activities) as prof:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        sync()
        t0 = time.perf_counter()
        run_global_batch(cfg, ddp, dataset, special, step=it, noise_step=it, objective=objective)
        sync()
        t1 = time.perf_counter()
        opt.step()
        sync()
        t2 = time.perf_counter()
    by_name: dict[str, float] = {}
    for e in prof.events():
        if cuda and e.device_type != DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us() if cuda else e.self_cpu_time_total
        by_name[e.name] = by_name.get(e.name, 0.0) + us / 1e3
    if cuda and not by_name:  # no kernel events in this torch's event list: the ops' self device time
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0
            by_name[e.key] = by_name.get(e.key, 0.0) + us / 1e3
    by_cat: dict[str, float] = {}
    for name, ms in by_name.items():
        by_cat[kernel_category(name)] = by_cat.get(kernel_category(name), 0.0) + ms
    heaviest = sorted(by_name.items(), key=lambda kv: -kv[1])
    kernel_ms = sum(by_cat.values())
    total = kernel_ms or 1.0
    return {
        "timed": "cuda kernels" if cuda else "cpu aten self time",
        "forward_backward_ms": 1e3 * (t1 - t0),
        "optimizer_ms": 1e3 * (t2 - t1),
        "profiled_step_ms": 1e3 * (t2 - t0),
        "unprofiled_step_ms": 1e3 * step_s if step_s else None,
        # device busy / the unprofiled step: well below 1 means the GPU waits on the host (launches, syncs)
        "busy_share": busy_share(kernel_ms, step_s) if cuda else None,
        "kernel_ms": {k: round(v, 2) for k, v in sorted(by_cat.items())},
        "share": {k: round(v / total, 3) for k, v in sorted(by_cat.items())},
        "top": [[k[:90], round(v, 2)] for k, v in heaviest[:TOP_KERNELS]],
        "top_elementwise": [[k[:90], round(v, 2)] for k, v in heaviest if kernel_category(k) == "elementwise"][
            :TOP_KERNELS
        ],
        # which SDPA kernels the step really ran (flash / cuDNN / memory-efficient): the backend, recorded
        "attention_kernels": [k[:90] for k, _ in heaviest if kernel_category(k) == "attention"][:4],
    }


def run_kernels(cfg, ddp) -> dict:
    """The kernels the measured steps use, as the trainer logs them (models/megatron/kernels.py), with the SDPA
    kernel picked at this layout (a --sdpa forced around the worker included)."""
    param = next(ddp.module.parameters())
    bidirectional = objective_class(cfg.diffusion.model_running_mode).bidirectional
    return {
        **kernel_settings(cfg).describe(),
        "sdpa_kernel": sdpa_choice(cfg, param.device, param.dtype, bidirectional),
    }


class Harness:
    """One job's shared state: the manifest, the peak, the datasets by sequence length."""

    def __init__(self, args, p: dict, job: dict):
        self.args, self.p, self.job = args, p, job
        self.manifest = DataManifest.read(args.manifest)
        self.vocab = self.manifest.tokenizer.vocab_size
        self.special = SpecialTokens.from_manifest(self.manifest.tokenizer)
        self.cuda = torch.cuda.is_available()
        self.peak = flops.peak_flops(torch.cuda.get_device_name() if self.cuda else None)
        self.datasets: dict[int, object] = {}
        self.largest = max(m for _, m in job.get("shapes") or [k["shape"] for k in job["knobs"]])

    def cfg(self, mode: str, seq: int, mbs: int, model: dict | None = None, preset: str | None = None):
        return config(
            self.p,
            Path(self.args.out) / "work",
            preset or self.job["preset"],
            seq,
            mode,
            steps=1000,
            train={"micro_batch_size": mbs, "global_batch_size": mbs, "schedule": {"warmup_iters": 10}},
            model={"document_attention": bool(self.job.get("documents")), **(model or {})},
        )

    def dataset(self, cfg):
        seq = cfg.train.seq_length
        if not self.datasets:
            init_distributed(cfg)
        if seq not in self.datasets:
            n = 64 * self.largest
            self.datasets[seq], _ = build_datasets(cfg, self.manifest, n, cfg.train.global_batch_size)
        return self.datasets[seq]

    def step_flops(self, cfg, mbs: int, pairs: list[float] | None, mode: str) -> float:
        """Mean model FLOPs of the timed steps (one micro-batch each), by `mode`'s objective."""
        objective = build_objective(config(self.p, Path(self.args.out) / "work", cfg.model.preset,
                                           cfg.train.seq_length, mode).diffusion)  # fmt: skip
        seq = cfg.train.seq_length
        if pairs is None:
            return flops.training_flops(cfg, self.vocab, [seq], mbs, objective=objective)
        return sum(flops.training_flops(cfg, self.vocab, [seq], mbs, [q], objective=objective) for q in pairs) / len(
            pairs
        )

    def measure(self, mode: str, seq: int, mbs: int, ddp, opt, model: dict | None = None, preset=None, **tags) -> dict:
        cfg = self.cfg(mode, seq, mbs, model, preset)
        # CUDA graphs are captured after megatron's warm-up steps (3): the timed steps replay them
        warmup = 1 + (3 if cfg.model.cuda_graphs != "off" else 0)
        timed = timed_steps(cfg, ddp, opt, self.dataset(cfg), self.special, self.p["timed_steps"], warmup)
        step, fwd_bwd = spread(timed["step_s"]), spread(timed["forward_backward_s"])
        step_flops = self.step_flops(cfg, mbs, timed["pairs"], mode)
        eff = flops.efficiency(step_flops, step["median"], 1, self.peak)
        # Megatron-LM's convention halves attention for every model (it assumes causal): AR's count
        megatron = flops.efficiency(self.step_flops(cfg, mbs, timed["pairs"], "ar"), step["median"], 1, self.peak)
        dense = seq * seq * mbs
        return {
            "mode": mode,
            "preset": cfg.model.preset,
            "seq": seq,
            "micro_batch": mbs,
            **tags,
            "step_s": step["median"],
            "step_min_s": step["min"],
            "step_max_s": step["max"],
            "timed_steps": step["n"],
            "forward_backward_s": fwd_bwd["median"],
            "tokens_per_s": mbs * seq / step["median"],
            "tflops": eff["tflops_per_device"],
            "mfu": eff["mfu"],
            "mfu_megatron": megatron["mfu"],
            # the documents' (query, key) pairs over s^2: the share of the dense mask a document mask computes
            "pairs_share": sum(timed["pairs"]) / len(timed["pairs"]) / dense if timed["pairs"] else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None,
        }

    def row(self, mode: str, seq: int, mbs: int, ddp, opt, model: dict | None = None, preset=None, **tags) -> dict:
        """A measured row, or the row's error (OOM, cuBLAS/NCCL failing to allocate): this row only."""
        try:
            row = self.measure(mode, seq, mbs, ddp, opt, model, preset, **tags)
        except Exception as exc:
            row = {"mode": mode, "seq": seq, "micro_batch": mbs, **tags, "oom": memory_error(exc),
                   "error": f"{type(exc).__name__}: {exc}"[:400]}  # fmt: skip
        append_row(self.args, row)  # (outside the handler: the exception's frames no longer hold the activations)
        free()
        return row

    def profile(self, row: dict, ddp, opt) -> None:
        cfg = self.cfg(row["mode"], row["seq"], row["micro_batch"])
        try:
            prof = profiled_step(cfg, ddp, opt, self.dataset(cfg), self.special, 99, row.get("step_s"))
        except Exception as exc:
            prof = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        prof.update(mode=row["mode"], seq=row["seq"], micro_batch=row["micro_batch"])
        append_row(self.args, {"mode": row["mode"], "profile": prof})
        free()


def worker_microbatch(args, p: dict) -> dict:
    """Job `args.job` of the plan: the first mode at every shape (a sweep stops at the first row that fails),
    profiled steps, the repeat of the headline row; the other modes at the largest fitting shape (or at every
    shape that fitted, `baseline_each`). Each row reaches the rows file as measured."""
    job = p["jobs"][args.job]
    h = Harness(args, p, job)
    rows: list[dict] = []
    fitted: list[tuple[int, int]] = []
    kernels_logged = False
    for i, mode in enumerate(job["modes"]):
        shapes = [tuple(s) for s in job["shapes"]] if i == 0 else fitted if job.get("baseline_each") else fitted[-1:]
        for seq in dict.fromkeys(s for s, _ in shapes):  # a model per length (RoPE, datasets), largest batch first
            h.dataset(h.cfg(mode, seq, h.largest))  # (the first one initialises torch.distributed and megatron)
            largest = h.cfg(mode, seq, h.largest)
            ddp, opt, _ = build_training(largest, h.vocab, objective=build_objective(largest.diffusion))
            if not kernels_logged:
                append_row(args, {"mode": mode, "kernels": run_kernels(h.cfg(mode, seq, h.largest), ddp)})
                kernels_logged = True
            for s, mbs in [x for x in shapes if x[0] == seq]:
                row = h.row(mode, s, mbs, ddp, opt)
                rows.append(row)
                if "error" in row and job.get("sweep"):
                    break
                if "error" not in row and i == 0:
                    fitted.append((s, mbs))
                    if job.get("profile") == "each":
                        h.profile(row, ddp, opt)
            if i == 0 and fitted and fitted[-1][0] == seq:
                best = next(r for r in reversed(rows) if "step_s" in r)
                if job.get("profile") == "best":
                    h.profile(best, ddp, opt)
                if job.get("repeat"):
                    rows.append(h.row(mode, best["seq"], best["micro_batch"], ddp, opt, repeat=True))
            del ddp, opt
            free()
    return summary(args.job, p, [*rows, *read_rows(args)])


def worker_knobs(args, p: dict) -> dict:
    """The MFU levers (model.compile, model.recompute, model.cuda_graphs: config switches), each a fresh model
    measured at its shape (and preset, default the job's), beside the same shape with every lever off; a lever's
    row that fails is recorded and the next runs."""
    job = p["jobs"][args.job]
    h = Harness(args, p, job)
    mode = job["modes"][0]
    rows = []
    for knob in job["knobs"]:
        seq, mbs = knob["shape"]
        model, preset = knob.get("model", {}), knob.get("preset")
        try:
            h.dataset(h.cfg(mode, seq, mbs, model, preset))
            lever = h.cfg(mode, seq, mbs, model, preset)
            ddp, opt, _ = build_training(lever, h.vocab, objective=build_objective(lever.diffusion))
        except Exception as exc:  # a lever that does not build here (no compiler, ...): its row says why
            row = {"knob": knob["name"], "mode": mode, "seq": seq, "micro_batch": mbs, "error": f"{exc}"[:400]}
            append_row(args, row)
            rows.append(row)
            continue
        rows.append(h.row(mode, seq, mbs, ddp, opt, model, preset, knob=knob["name"]))
        del ddp, opt
        free()
    return {"rows": rows, "off": next((r.get("mfu") for r in rows if r.get("knob") == "off"), None)}


def read_rows(args) -> list[dict]:
    """The profile and kernel lines of the rows file (the measured rows are in hand)."""
    path = Path(args.rows) if getattr(args, "rows", None) else None
    if not path or not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x for x in lines if "profile" in x or "kernels" in x]
