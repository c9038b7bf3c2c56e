"""The environment section (versions, device, what came from the wheels) and the probe: ~10 s of the things
that would break every later section (collectives, the SDPA backend at each attention layout, the matmul and
copy ceilings that say what 'achievable' means on this device).

torch, psutil and megatron are imported inside the functions: this module is imported before the wheels'
install (benchmarks/gpu/runtime.py), which is what makes them importable.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

from benchmarks.gpu.runtime import OFFLINE, SectionFailed, present

SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def _safe(fn):
    """An optional figure of the environment: its error text instead of a failed section."""
    try:
        return fn()
    except Exception as exc:
        return f"unknown ({type(exc).__name__}: {exc})"[:200]


def environment(installed: list[str]) -> dict:
    import psutil  # fail fast: megatron's dist_checkpointing.save hangs without it
    import torch

    cuda = torch.cuda.is_available()
    megatron = importlib.import_module("megatron.core.package_info")

    def nccl():
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)

    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": _safe(lambda: torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None),
        "nccl": _safe(nccl) if cuda else None,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": _safe(lambda: ".".join(map(str, torch.cuda.get_device_capability()))) if cuda else None,
        "memory_gb": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "megatron_core": megatron.__version__,
        "megatron_path": str(Path(megatron.__file__).parents[2]),
        "pydantic": version("pydantic"),
        "typing_extensions": _safe(lambda: version("typing-extensions")),
        "psutil": psutil.__version__,
        "transformer_engine": present("transformer_engine"),
        # torch.compile's CUDA kernels (compiled SwiGLU, fused CE, FlexAttention) need Triton and a C compiler
        "triton": _safe(lambda: version("triton")) if present("triton") else None,
        "c_compiler": next((shutil.which(c) for c in ("gcc", "cc", "clang") if shutil.which(c)), None),
        "installed_from_wheels": installed,
        "cpus": os.cpu_count(),
        "env": {k: os.environ.get(k) for k in (*OFFLINE, "PYTORCH_CUDA_ALLOC_CONF", "NCCL_SOCKET_IFNAME")},
    }
    if cuda:
        env["sdpa_enabled"] = _safe(
            lambda: {
                "flash": torch.backends.cuda.flash_sdp_enabled(),
                "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            }
        )
    return env


# ---- probe: ~10 s of the things that would break every later section ----------------------------------------
def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, iters: int, warmup: int = 1) -> float:
    """Milliseconds per call after `warmup` calls."""
    for _ in range(warmup):
        fn()
    _sync()
    tic = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return 1e3 * (time.perf_counter() - tic) / iters


COLLECTIVES_PROBE = """
import json, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
out = {}
for backend, port in zip(sys.argv[1].split(","), sys.argv[2:]):
    tic = time.perf_counter()
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0,
                                timeout=timedelta(seconds=30))
        x = torch.ones(1024, device="cuda" if backend == "nccl" else "cpu")
        dist.all_reduce(x)
        if backend == "nccl":
            torch.cuda.synchronize()
        out[backend] = {"ok": bool(x.sum().item() == 1024), "seconds": round(time.perf_counter() - tic, 3)}
    except Exception as exc:
        out[backend] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
print(json.dumps(out))
"""


def probe_collectives(timeout: float = 90) -> dict:
    """A one-rank all-reduce on each backend this machine should run (NCCL on CUDA, gloo always), in a child:
    a hung or aborting NCCL (its watchdog kills the process) must not take the check with it."""
    import torch

    from difflm.models.launch.torchrun import free_port

    backends = ("nccl", "gloo") if torch.cuda.is_available() else ("gloo",)
    cmd = [sys.executable, "-c", COLLECTIVES_PROBE, ",".join(backends), *(str(free_port()) for _ in backends)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return {b: {"ok": False, "error": f"no answer in {timeout:.0f} s (hung)"} for b in backends}
    except (json.JSONDecodeError, IndexError):
        text = f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-500:]}"
        return {b: {"ok": False, "error": text} for b in backends}


def attention_layouts(p: dict) -> dict:
    """(batch, heads, query groups, head dim, seq) of the 1B and 350M presets as the sections run them."""
    from difflm.config import MODEL_PRESETS

    out = {}
    for name, preset, mbs, seq in (
        ("1b", p["big"], p["probe_mbs"], p["big_seq"]),
        ("350m", p["small"], p["mbs"], p["seq"]),
    ):
        m = MODEL_PRESETS[preset]
        heads = m["num_attention_heads"]
        out[name] = (mbs, heads, m.get("num_query_groups") or heads, m["hidden_size"] // heads, seq)
    return out


def _qkv(b: int, n: int, g: int, d: int, s: int, device, dtype):
    """q, k, v as megatron hands them to TorchCoreAttention: q and k fresh (RoPE's outputs), v a strided view
    of the fused QKV buffer [s, b, g, (n/g + 2) d]; each permuted to [b, n, s, d]."""
    import torch

    mixed = torch.randn(s, b, g, (n // g + 2) * d, device=device, dtype=dtype)
    q, k, v = torch.split(mixed, [n // g * d, d, d], dim=3)
    q = q.reshape(s, b, n, d).contiguous().requires_grad_()
    k = k.contiguous().requires_grad_()
    v = v.detach().requires_grad_()  # keeps the buffer's strides
    return [x.permute(1, 2, 0, 3) for x in (q, k, v)]


def probe_attention(p: dict) -> dict:
    """The SDPA backend PyTorch picks at each layout and direction, and forward+backward milliseconds under each
    backend forced (an error is recorded, not raised: that backend is then not the one to force)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    names = {int(v): k for k, v in SDPBackend.__members__.items()}
    out = {}
    for layout, (b, n, g, d, s) in attention_layouts(p).items():
        q, k, v = _qkv(b, n, g, d, s, device, dtype)
        grad = torch.randn_like(q)
        for causal in (False, True):
            key = f"{layout}-{'causal' if causal else 'bidirectional'}"
            row = {"batch_heads_groups_dim_seq": [b, n, g, d, s]}
            kw = {"is_causal": causal, "enable_gqa": g != n}
            try:
                row["chosen"] = names.get(int(torch._fused_sdp_choice(q, k, v, **kw)), "?")
            except Exception as exc:
                row["chosen"] = f"error: {exc}"[:200]

            def step(q=q, k=k, v=v, grad=grad, kw=kw):
                torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, **kw), (q, k, v), grad)

            for backend in ("default", *(SDPA_BACKENDS if cuda else ("MATH",))):
                try:
                    if backend == "default":
                        row["default_ms"] = round(_timed(step, p["probe_iters"]), 3)
                    else:
                        with sdpa_kernel([getattr(SDPBackend, backend)]):
                            row[f"{backend.split('_')[0].lower()}_ms"] = round(_timed(step, p["probe_iters"]), 3)
                except Exception as exc:
                    row[f"{backend.split('_')[0].lower()}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            out[key] = row
    return out


def probe_ceilings(p: dict) -> dict:
    """bf16 matmul TFLOP/s (fp32 on the CPU) and device-to-device copy GB/s: what 'achievable' means here."""
    import torch

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    n = p["probe_matmul"]
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    ms = _timed(lambda: a @ b, p["probe_iters"] * 3)
    src = torch.empty(p["probe_copy_mb"] * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = _timed(lambda: dst.copy_(src), p["probe_iters"] * 3)
    return {
        "matmul": {"n": n, "dtype": str(dtype), "ms": round(ms, 3), "tflops": round(2 * n**3 / ms / 1e9, 3)},
        "copy": {"mb": p["probe_copy_mb"], "gb_per_s": round(2 * src.numel() / copy_ms / 1e6, 1)},
    }


def probe(p: dict) -> dict:
    import torch

    tic = time.perf_counter()
    out = {"collectives": probe_collectives()}
    out["attention"] = probe_attention(p)
    out["ceilings"] = probe_ceilings(p)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out["seconds"] = round(time.perf_counter() - tic, 2)
    bad = [b for b, r in out["collectives"].items() if not r["ok"]]
    if bad:  # reported in full; the section fails so the report says so at the top
        raise SectionFailed(f"all-reduce failed on {', '.join(bad)}", out)
    return out
