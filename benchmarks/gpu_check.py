"""One-shot GPU check: everything that needs a GPU, in one run, with a markdown + JSON report.

    python benchmarks/gpu_check.py REPORT_DIR              # on one H100/H200-class GPU: about 6-8 minutes
    python benchmarks/gpu_check.py REPORT_DIR --dry-run    # the same code path on the CPU at a tiny size
    bash benchmarks/gpu_run.sh                             # the one command for the GPU machine (docs/gpu-check.md)

It runs in a bare, offline CUDA environment that has only Python, PyTorch, transformers, safetensors,
tokenizers, numpy, pyyaml, psutil and pytest: megatron-core and pydantic (and typing-extensions / psutil where
the image's are missing or too old) are installed from the wheels that `benchmarks/gpu_wheels.py` downloads
beforehand into `benchmarks/gpu_wheels/` (no network, no Transformer Engine: the default GPU backend is then
`torch`, megatron-core's layers on PyTorch's SDPA). It imports only the trainer and the HF export (no Prefect,
MLflow or datatrove) and makes its own data: a pre-tokenised synthetic corpus from a sparse Markov chain (4
successors per token), so that the loss has somewhere to fall (its entropy is log 4 = 1.39 nats/token) and a
sample can be judged by how many of its token pairs the chain allows.

Sections, in this order (the most valuable figures first; a timeout cuts only the last), each timed and
reported even when another fails:
  environment     versions, device, what came from the wheels
  probe           ~10 s: a one-rank NCCL (and gloo) all-reduce; the SDPA backend PyTorch picks and each
                  backend's forward+backward time at the 1B and 350M attention layouts; bf16 matmul and
                  device-to-device copy ceilings
  data            the Markov corpus
  microbatch-1b   the 1B preset at seq 2048: micro-batches in increasing size until one does not fit, the MFU
                  of each, one profiled step (GEMM / attention / elementwise / optimizer), the AR baseline at
                  the largest size (MFU of both: bidirectional attention does twice the attention FLOPs)
  train-difflm    150 steps of the 350M preset in bf16, masked diffusion: tokens/s, MFU, peak memory, loss
  export          the trained checkpoint -> HF folder, loaded in fp32 and bf16: logits against megatron's on a
                  half-masked batch, the masked-token loss, ELBO, a sample
  spec-parity     first-step loss of the torch spec against megatron's local spec on the same weights and batch
  gpu-tests       the `gpu`-marked tests without FlexAttention (no compiles)
  train-ar        the autoregressive baseline, 150 steps
  gpu-tests-flex  the FlexAttention / packed-document `gpu` tests (8 Inductor compiles: minutes)

report.json and report.md are rewritten at the start and end of every section and whenever a worker writes a
row; each section prints one JSON line on stdout ({"section": ..., "status": ..., "seconds": ..., "result": ...}),
each measured row one more ({"section": ..., "row": ...}). A killed run leaves every finished section's figures.
The test suite runs `--dry-run` in an environment built like the GPU image, so this script cannot rot.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# module -> distribution: installed from the wheels when absent
NEEDED = {"megatron.core": "megatron-core", "pydantic": "pydantic", "psutil": "psutil"}
# distribution -> the oldest version that works (pydantic 2.14: `ImportError: Sentinel` with 4.12)
MIN_VERSIONS = {"typing-extensions": (4, 14)}
GOAL_MFU_1B = 0.45
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_DATASETS_OFFLINE": "1",
}
SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
# `gpu` tests that compile FlexAttention (packed documents on CUDA): run last
FLEX_TESTS = "documents or docs or flex or thd"


# ---- environment --------------------------------------------------------------------------------------
def present(module: str) -> bool:
    """Whether `module` can be imported. find_spec of a submodule imports its parent package, and raises
    ModuleNotFoundError (does not return None) when that parent is absent: `megatron.core` without `megatron`."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def version_tuple(text: str) -> tuple[int, ...]:
    import re

    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def missing_packages() -> list[str]:
    """Distributions to install from the wheels: absent modules, and versions below MIN_VERSIONS."""
    from importlib.metadata import PackageNotFoundError, version

    missing = [pkg for mod, pkg in NEEDED.items() if not present(mod)]
    for dist, least in MIN_VERSIONS.items():
        try:
            have = version_tuple(version(dist))
        except PackageNotFoundError:
            have = ()
        if have < least:
            missing.append(dist)
    return missing


def has_pip() -> bool:
    """Asked of a child: find_spec("pip") in this process would switch setuptools' _distutils_hack to pip mode,
    and torch's cpp_extension (imported by megatron) then fails on `import setuptools`."""
    return subprocess.run([sys.executable, "-c", "import pip"], capture_output=True).returncode == 0


def install_wheels(wheels: Path, site: Path) -> None:
    """pip install --target (no index, no deps); an image without pip gets the wheels unpacked (a wheel is a zip
    of its site-packages files)."""
    found = sorted(wheels.glob("*.whl"))
    if has_pip():
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index"]
        cmd += ["--no-deps", "--find-links", str(wheels), "--target", str(site), *map(str, found)]
        subprocess.run(cmd, check=True)
        return
    import zipfile

    site.mkdir(parents=True, exist_ok=True)
    for wheel in found:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)


def ensure_dependencies(wheels: Path, site: Path) -> list[str]:
    """Install what the bare GPU image lacks from local wheels (no index, no network) into `site`, first on
    sys.path and on the children's PYTHONPATH."""
    missing = missing_packages()
    if missing:
        if not wheels.is_dir() or not any(wheels.glob("*.whl")):
            raise SystemExit(
                f"missing {', '.join(missing)} and no wheels in {wheels}: run "
                f"`python benchmarks/gpu_wheels.py` on a machine with network access first, and carry "
                f"benchmarks/gpu_wheels to the GPU machine (it is git-ignored)"
            )
        install_wheels(wheels, site)
        sys.path.insert(0, str(site))
        importlib.invalidate_caches()
        for name in [m for m in sys.modules if m == "typing_extensions"]:
            del sys.modules[name]  # a copy imported before the install: take the wheel's
        still = missing_packages()
        if still:
            raise SystemExit(f"still missing after installing {wheels}: {', '.join(still)}")
    paths = [str(ROOT), *([str(site)] if missing else []), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return missing


def offline_environment() -> None:
    """This process and its children: no hub access (the export and load_hf run here), loopback sockets,
    unbuffered children (their logs are read while they run)."""
    for key, value in {
        **OFFLINE,
        "PYTHONUNBUFFERED": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }.items():
        os.environ.setdefault(key, value)


def _safe(fn):
    """An optional figure of the environment: its error text instead of a failed section."""
    try:
        return fn()
    except Exception as exc:
        return f"unknown ({type(exc).__name__}: {exc})"[:200]


def environment(installed: list[str]) -> dict:
    from importlib.metadata import version

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

    from models.launch.torchrun import free_port

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


class SectionFailed(RuntimeError):
    """A section that failed with figures worth keeping."""

    def __init__(self, message: str, partial: dict):
        super().__init__(message)
        self.partial = partial


# ---- sizes --------------------------------------------------------------------------------------------
def plan(dry: bool) -> dict:
    """Every size in one place: the GPU figures, or a tiny CPU run of the same code."""
    if dry:
        return {
            "dry": True,
            "vocab": 512,
            "documents": 64,
            "doc_len": 700,
            "small": "tiny",
            "seq": 64,
            "mbs": 2,
            "steps": 6,
            "precision": "bf16",
            "big": "tiny",
            "big_seq": 64,
            "mbs_sizes": [1, 2],
            "timed_steps": 1,
            "parity_mbs": 2,
            "sample_len": 16,
            "timeout": 300,
            "probe_mbs": 2,
            "probe_iters": 2,
            "probe_matmul": 256,
            "probe_copy_mb": 8,
        }
    return {
        "dry": False,
        "vocab": 32768,
        "documents": 1500,
        "doc_len": 4000,
        "small": "350m",
        "seq": 2048,
        "mbs": 8,
        "steps": 150,
        "precision": "bf16",
        "big": "1b",
        "big_seq": 2048,
        "mbs_sizes": [8, 12, 16, 24],  # measured on an H200: 24 fits (111 GB with the fused kernels), 32 would not
        "timed_steps": 4,
        "parity_mbs": 2,
        "sample_len": 128,
        "timeout": 420,
        "probe_mbs": 16,
        "probe_iters": 5,
        "probe_matmul": 8192,
        "probe_copy_mb": 1024,
    }


def config(p: dict, workdir: Path, preset: str, seq: int, mode: str, **train):
    from difflm.config import validate

    t = {
        "seq_length": seq,
        "micro_batch_size": p["mbs"],
        "global_batch_size": p["mbs"],
        "train_iters": p["steps"],
        "lr": 3e-4 if preset != "tiny" else 3e-3,
        "min_lr": 3e-5,
        "warmup_iters": max(1, p["steps"] // 10),
        "log_interval": max(1, p["steps"] // 12),
        "eval_interval": p["steps"],
        "eval_iters": 2,
        "precision": p["precision"],
        **train,
    }
    return validate(
        {
            "name": f"gpu-check-{preset}",
            "workdir": str(workdir),
            "model": {"preset": preset, "backend": "auto"},
            "diffusion": {"model_running_mode": mode},
            "train": t,
            "checkpoint": {"save_interval": p["steps"], "keep_last": 1},
        }
    )


# ---- data: a Markov-chain corpus, pre-tokenised ----------------------------------------------------------
SPECIALS = ["<|endoftext|>", "<|mask|>", "<|pad|>"]
SUCCESSORS = 4


def markov_table(vocab: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(len(SPECIALS), vocab, size=(vocab, SUCCESSORS))


def make_dataset(p: dict, folder: Path) -> dict:
    """Megatron .bin/.idx train and valid splits + an HF tokenizer folder; returns the data manifest."""
    import hashlib

    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    vocab, table = p["vocab"], markov_table(p["vocab"])
    rng = np.random.default_rng(1)
    docs = np.empty((p["documents"], p["doc_len"]), dtype=np.int64)  # chains advance together: one column a step
    docs[:, 0] = rng.integers(len(SPECIALS), vocab, size=p["documents"])
    for j in range(1, p["doc_len"]):
        docs[:, j] = table[docs[:, j - 1], rng.integers(0, SUCCESSORS, size=p["documents"])]
    tok_dir = folder / "tokenizer"
    tok_sha = save_tokenizer(vocab, tok_dir)
    splits = {}
    n_valid = max(2, p["documents"] // 20)
    for split, rows in (("valid", docs[:n_valid]), ("train", docs[n_valid:])):
        prefix = folder / split / "00000_tokens"
        prefix.parent.mkdir(parents=True, exist_ok=True)
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
        for row in rows:
            builder.add_document(torch.from_numpy(np.append(row, 0).astype(np.int64)), [len(row) + 1])
        builder.finalize(f"{prefix}.idx")
        splits[split] = {
            "documents": len(rows),
            "tokens": int(rows.size + len(rows)),
            "prefixes": [str(prefix)],
            "weights": [1.0],
        }
    splits["test"] = {"documents": 0, "tokens": 0, "prefixes": [], "weights": []}
    manifest = {
        "dir": str(folder),
        "hash": hashlib.sha256(tok_sha.encode()).hexdigest()[:12],
        "tokenizer": {
            "path": str(tok_dir),
            "vocab_size": vocab,
            "eos_id": 0,
            "mask_id": 1,
            "pad_id": 2,
            "sha256": tok_sha,
            "special_ids": [0, 1, 2],
        },
        "token_bytes": 2,
        "splits": splits,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    np.save(folder / "markov.npy", table)
    return manifest


def save_tokenizer(vocab: int, folder: Path) -> str:
    """A word-level tokenizer whose tokens are w3 .. w{vocab-1}: samples decode to readable ids."""
    import hashlib

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {s: i for i, s in enumerate(SPECIALS)} | {f"w{i}": i for i in range(len(SPECIALS), vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIALS[0], mask_token=SPECIALS[1], pad_token=SPECIALS[2]
    ).save_pretrained(str(folder))
    return hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()


def chain_fraction(tokens, table) -> float:
    """Share of adjacent pairs (a, b) the Markov chain allows: ~1 for a model that learnt it, ~4/V for noise."""
    pairs = [(a, b) for a, b in zip(tokens[:-1], tokens[1:]) if a >= len(SPECIALS) and b >= len(SPECIALS)]
    return sum(b in table[a] for a, b in pairs) / max(len(pairs), 1)


# ---- subprocesses ---------------------------------------------------------------------------------------
class Interrupted(BaseException):
    """SIGTERM / SIGINT to the check (an outer `timeout`): the section in flight is marked killed, the report
    written, the children stopped."""


def _stop(proc: subprocess.Popen) -> None:
    """The child and all its descendants (torchrun starts its worker in a session of its own): SIGTERM, then
    SIGKILL to what is left."""
    import psutil

    if proc.poll() is not None:
        return
    try:
        parent = psutil.Process(proc.pid)
        tree = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in tree:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, tree = psutil.wait_procs(tree, timeout=5)  # the trainer takes SIGTERM as preemption: no time for that
        if not tree:
            break
    proc.poll()


def run_logged(cmd: list[str], log: Path, timeout: float, poll=None) -> int:
    """Run `cmd` in its own process group with its output in `log` (written as it comes); `poll()` every
    second while it runs (rows to the report); stopped at `timeout` or when the check is interrupted."""
    deadline = time.time() + timeout
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            while True:
                try:
                    proc.wait(timeout=1)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if poll:
                    poll()
                if time.time() > deadline:
                    _stop(proc)
                    raise subprocess.TimeoutExpired(cmd, timeout)
        finally:
            _stop(proc)
    if poll:
        poll()
    return proc.returncode


def _tail(log: Path, n: int = 25) -> str:
    return "".join(log.read_text(errors="replace").splitlines(True)[-n:]) if log.exists() else ""


def torchrun(args: list[str], log: Path, timeout: float, poll=None) -> None:
    """One process under torchrun (the trainer's own launch path); the log keeps its output."""
    from models.launch.torchrun import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        *args,
    ]
    code = run_logged(cmd, log, timeout, poll)
    if code:
        raise RuntimeError(f"exit {code}; last lines of {log}:\n{_tail(log)}")


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSON-lines file another process may be writing."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return rows


def save(cfg, path: Path) -> Path:
    from difflm.config import save_config

    return save_config(cfg, path)


# ---- the run: report, budget, sections --------------------------------------------------------------------
class Check:
    """The report (rewritten after every change), the time budget and the section runner."""

    def __init__(self, out: Path, p: dict, budget_s: float, meta: dict, only: set[str] | None = None):
        self.out, self.p, self.budget_s, self.only = out, p, budget_s, only
        self.started = time.time()
        self.report = {**meta, "plan": p, "environment": {}, "sections": {}, "seconds": 0.0}
        self.sections = self.report["sections"]

    def left(self) -> float:
        return self.budget_s - (time.time() - self.started)

    def timeout(self) -> float:
        """A child's timeout: the plan's, cut to the budget left (the copy-back after an outer timeout needs the
        check to end on its own)."""
        return max(10.0, min(self.p["timeout"], self.left()))

    def write(self) -> None:
        self.report["seconds"] = time.time() - self.started
        for name, text in (
            ("report.json", json.dumps(self.report, indent=1, default=str)),
            ("report.md", markdown(self.report)),
        ):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out / name)  # a reader (or a kill) never sees half a report

    def emit(self, line: dict) -> None:
        print(json.dumps(line, default=str), flush=True)

    def rows(self, name: str, path: Path, summarise=None):
        """A poll callback: new rows of `path` go into the section's partial result, the report and stdout."""
        seen = [0]

        def poll():
            rows = read_jsonl(path)
            if len(rows) == seen[0]:
                return
            self.sections[name]["partial"] = summarise(rows) if summarise else {"rows": rows}
            self.write()  # the report first: a row on stdout is already in the report
            for row in rows[seen[0] :]:
                self.emit({"section": name, "row": row})
            seen[0] = len(rows)

        return poll

    def skip(self, name: str, why: str) -> None:
        self.sections[name] = {"status": why, "seconds": 0.0}
        self.write()
        self.emit({"section": name, "status": "skipped", "seconds": 0.0, "why": why})

    def section(self, name: str, fn, need_s: float = 0):
        if self.only and name not in self.only | ALWAYS:
            self.skip(name, "skipped: not in --only")
            return None
        left = self.left()
        if left < need_s:
            self.skip(name, f"skipped: {left:.0f} s of the time budget left")
            return None
        tic = time.time()
        entry = self.sections[name] = {"status": "running", "seconds": 0.0}
        self.write()
        print(f"[gpu-check] {name} ...", file=sys.stderr, flush=True)
        result = None
        try:
            result = fn()
            entry.update(status="ok", result=result)
            entry.pop("partial", None)
        except Interrupted:
            entry.update(status="killed", seconds=time.time() - tic)
            self.write()
            self.emit(
                {"section": name, "status": "killed", "seconds": entry["seconds"], "result": entry.get("partial")}
            )
            raise
        except SectionFailed as exc:
            entry.update(status="failed", error=str(exc), partial=exc.partial)
        except subprocess.TimeoutExpired as exc:  # its child ran out of time (plan or budget): rows kept
            entry.update(status="timeout", error=f"{exc}")
        except (Exception, SystemExit):  # a failed section is reported; the others still run
            entry.update(status="failed", error=traceback.format_exc())
        entry["seconds"] = time.time() - tic
        self.write()
        self.emit(
            {
                "section": name,
                "status": entry["status"],
                "seconds": round(entry["seconds"], 2),
                "result": result if result is not None else entry.get("partial"),
                **({"error": entry["error"][-600:]} if "error" in entry else {}),
            }
        )
        return result


# ---- sections -------------------------------------------------------------------------------------------
def gpu_tests(check: Check, name: str, selection: str) -> dict:
    """The `gpu`-marked tests of `selection` (-k), their output in NAME.log as it comes."""
    files = [f for f in ("tests/gpu/test_gpu.py", "tests/unit/models/hf/test_hf_device.py") if (ROOT / f).exists()]
    log = check.out / f"{name}.log"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-k", selection, "-q", "-p", "no:cacheprovider", *files]
    code = run_logged(cmd, log, check.timeout())
    summary = (log.read_text(errors="replace").strip().splitlines() or [""])[-1]
    if code not in (0, 5):  # 5: nothing selected
        raise RuntimeError(f"gpu tests failed: {summary}\n{_tail(log, 60)}")
    return {"summary": summary, "selection": selection}


def train_summary(p: dict, mode: str, run_dir: Path, rows: list[dict]) -> dict:
    logged = [r for r in rows if r.get("loss") is not None]
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    steady = logged[1:] or logged  # the first interval includes compilation and warm-up

    def mean(key):
        have = [r[key] for r in steady if r.get(key) is not None]
        return sum(have) / len(have) if have else None

    return {
        "mode": mode,
        "preset": p["small"],
        "seq": p["seq"],
        "micro_batch": p["mbs"],
        "steps": p["steps"],
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


def train(check: Check, name: str, manifest: Path, mode: str) -> dict:
    p, out = check.p, check.out
    cfg = config(p, out / "work", p["small"], p["seq"], mode)
    run_dir = out / f"run-{mode}"
    cfg_path = save(cfg, out / f"config-{mode}.yaml")
    metrics = run_dir / "metrics.jsonl"
    torchrun(
        [
            "-m",
            "models.megatron.train",
            "--config",
            str(cfg_path),
            "--manifest",
            str(manifest),
            "--run-dir",
            str(run_dir),
        ],
        out / f"train-{mode}.log",
        check.timeout(),
        check.rows(name, metrics, lambda rows: train_summary(p, mode, run_dir, rows)),
    )
    return train_summary(p, mode, run_dir, read_jsonl(metrics))


def worker(check: Check, kind: str, manifest: Path, name: str | None = None, **extra) -> dict:
    """Run this script's `--worker KIND` under torchrun; returns the JSON it writes. Rows it appends to
    KIND-rows.jsonl reach the report as they come."""
    out, p = check.out, check.p
    result = out / f"{kind}.json"
    rows = out / f"{kind}-rows.jsonl"
    rows.unlink(missing_ok=True)
    cmd = [
        str(Path(__file__).resolve()),
        str(out),
        "--worker",
        kind,
        "--manifest",
        str(manifest),
        "--result",
        str(result),
        "--rows",
        str(rows),
        *(["--dry-run"] if p["dry"] else []),
        *(["--sdpa", check.report["sdpa_forced"]] if check.report.get("sdpa_forced") else []),
    ]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    torchrun(cmd, out / f"{kind}.log", check.timeout(), check.rows(name, rows) if name else None)
    return json.loads(result.read_text())


MARGIN = 1.0  # logits: a reference top-2 gap above this is a decided token (bf16 rounding is ~0.01-0.1)


def export(check: Check, manifest: Path, trained: dict) -> dict:
    """Megatron's fp32 logits of the trained checkpoint (worker) against the HF export in fp32 and bf16, on a
    batch with half its tokens masked (the positions training scores; clean positions have near-ties that
    bf16 rounding flips). bf16 passes on the masked-token loss and on the top-1 of decided tokens."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from difflm.config import load_config
    from difflm.rundir import RunDir
    from models.hf.convert import export_hf, load_hf

    p, out = check.p, check.out
    run = RunDir(trained["run_dir"])
    cfg = load_config(str(out / "config-difflm-noshift.yaml"))
    ckpt = run.checkpoint(run.latest_iteration())
    ref = worker(check, "logits", manifest, checkpoint=ckpt, config=out / "config-difflm-noshift.yaml")
    man = json.loads(manifest.read_text())
    folder = export_hf(cfg, man["tokenizer"], ckpt, out / "hf")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = torch.load(ref["batch"])
    vocab = man["tokenizer"]["vocab_size"]
    tokens, clean, masked = batch["tokens"].to(device), batch["clean"].to(device), batch["masked"].to(device)
    ref_logits = batch["logits"].to(device)[..., :vocab]
    top2 = ref_logits.topk(2, dim=-1).values
    decided = masked & (top2[..., 0] - top2[..., 1] > MARGIN)
    ref_loss = F.cross_entropy(ref_logits[masked], clean[masked]).item()
    report = {
        "checkpoint": str(ckpt),
        "folder": str(folder),
        "masked_tokens": int(masked.sum()),
        "decided_tokens": int(decided.sum()),
        "megatron_masked_loss": ref_loss,
    }
    table = np.load(Path(man["dir"]) / "markov.npy")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = load_hf(folder).to(device=device, dtype=dtype)
        with torch.no_grad():
            logits = model(tokens).logits.float()[..., :vocab]
        diff = (logits - ref_logits).abs()
        agree = logits.argmax(-1) == ref_logits.argmax(-1)
        loss = F.cross_entropy(logits[masked], clean[masked]).item()
        gen = torch.Generator().manual_seed(0)  # noise is drawn on the CPU (NOISE_DEVICE), on every device
        nll = model.elbo_nll(clean[:2], t_samples=4, generator=gen)
        nll = float(nll.float().mean()) if torch.is_tensor(nll) else float(nll)
        prompt = clean[:1, :8]
        with torch.no_grad():
            out_ids = model.diffusion_generate(prompt, length=p["sample_len"], steps=p["sample_len"])
        sample = out_ids[0, prompt.shape[1] :].tolist()
        report[name] = {
            "max_abs_diff": diff.max().item(),
            "mean_abs_diff": diff.mean().item(),
            "top1_agreement_masked": agree[masked].float().mean().item(),
            "top1_agreement_decided": agree[decided].float().mean().item() if decided.any() else None,
            "masked_loss": loss,
            "masked_loss_rel_diff": abs(loss - ref_loss) / max(abs(ref_loss), 1e-9),
            "elbo_nll": nll,
            "sample_chain_fraction": chain_fraction(sample, table),
            "sample": " ".join(f"w{t}" if t >= len(SPECIALS) else SPECIALS[t] for t in sample[:24]),
        }
        del model
    report["chance_chain_fraction"] = SUCCESSORS / (vocab - len(SPECIALS))
    report["fp32_parity_ok"] = report["fp32"]["max_abs_diff"] < 1e-3 * max(1.0, ref_logits.abs().max().item())
    bf16 = report["bf16"]
    report["bf16_parity_ok"] = bf16["masked_loss_rel_diff"] < 0.02 and (
        bf16["top1_agreement_decided"] is None or bf16["top1_agreement_decided"] >= 0.98
    )
    return report


# ---- workers (run under torchrun, one process) ------------------------------------------------------------
def _init(cfg):
    from models.megatron.train import init_distributed

    init_distributed(cfg)


def worker_logits(args, p: dict) -> dict:
    """Megatron's fp32 logits of a checkpoint on a fixed validation batch with half its tokens masked."""
    import torch

    from difflm.config import load_config
    from models.megatron import checkpointing
    from models.megatron.data import build_datasets
    from models.megatron.gpt import build_model

    cfg = load_config(args.config, ["train.precision=fp32"])
    manifest = json.loads(Path(args.manifest).read_text())
    _init(cfg)
    _, valid = build_datasets(cfg, manifest, cfg.train.global_batch_size, 4 * cfg.train.global_batch_size)
    clean = torch.stack([valid[i]["tokens"][: min(256, cfg.train.seq_length)] for i in range(2)])
    masked = torch.rand(clean.shape, generator=torch.Generator().manual_seed(0)) < 0.5
    tokens = torch.where(masked, manifest["tokenizer"]["mask_id"], clean)
    model = build_model(cfg, manifest["tokenizer"]["vocab_size"])
    if torch.cuda.is_available():
        model.cuda()
    checkpointing.load_model_weights(Path(args.checkpoint), model)
    model.eval()
    device = next(model.parameters()).device
    pos = torch.arange(tokens.shape[1], device=device)[None].expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = model(tokens.to(device), pos, None).float().cpu()
    path = Path(args.out) / "megatron-logits.pt"
    torch.save({"tokens": tokens, "clean": clean, "masked": masked, "logits": logits}, path)
    return {"batch": str(path)}


def worker_parity(args, p: dict) -> dict:
    """First-step loss of the same weights and batch on the local spec and the torch spec, fp32 and bf16."""
    import torch

    from models.megatron.data import build_datasets
    from models.megatron.forward_step import SpecialTokens
    from models.megatron.train import build_training, run_global_batch

    manifest = json.loads(Path(args.manifest).read_text())
    out: dict = {}
    weights = None
    for precision in ("fp32", "bf16"):
        for backend in ("local", "torch"):
            cfg = config(
                p,
                Path(args.out) / "work",
                p["small"],
                p["seq"],
                "difflm-noshift",
                micro_batch_size=p["parity_mbs"],
                global_batch_size=p["parity_mbs"],
                precision=precision,
            )
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"backend": backend})})
            if not out:
                _init(cfg)
                train_ds, _ = build_datasets(cfg, manifest, cfg.train.global_batch_size, cfg.train.global_batch_size)
                special = SpecialTokens.from_manifest(manifest["tokenizer"])
            torch.manual_seed(0)
            ddp, _, _ = build_training(cfg, manifest["tokenizer"]["vocab_size"])
            inner = ddp.module.module if precision == "bf16" else ddp.module  # Float16Module wraps in bf16
            if weights is None:
                weights = {
                    k: v.detach().float().cpu().clone() for k, v in inner.state_dict().items() if torch.is_tensor(v)
                }
            else:
                inner.load_state_dict(
                    {k: v.to(dtype=inner.state_dict()[k].dtype) for k, v in weights.items()}, strict=False
                )
            out[f"{backend}-{precision}"] = run_global_batch(cfg, ddp, train_ds, special, step=0, noise_step=0)
            _append_row(args, {"spec": backend, "precision": precision, "loss": out[f"{backend}-{precision}"]})
            del ddp
            _free()
    out["fp32_rel_diff"] = abs(out["torch-fp32"] - out["local-fp32"]) / abs(out["local-fp32"])
    out["bf16_rel_diff"] = abs(out["torch-bf16"] - out["local-bf16"]) / abs(out["local-bf16"])
    return out


def _append_row(args, row: dict) -> None:
    """A measured row, at once: a line in the rows file (the main process puts it in the report) and stdout."""
    line = json.dumps(row, default=str)
    print(line, flush=True)
    if getattr(args, "rows", None):
        with open(args.rows, "a") as f:
            f.write(line + "\n")


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _timed_steps(cfg, ddp, opt, dataset, special, steps: int, warmup: int = 1) -> float:
    """Seconds per training step (forward, backward, optimizer) after `warmup` steps."""
    from models.megatron.train import run_global_batch

    for i in range(warmup + steps):
        if i == warmup:
            _sync()
            tic = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        run_global_batch(cfg, ddp, dataset, special, step=i, noise_step=i)
        opt.step()
    _sync()
    return (time.perf_counter() - tic) / steps


def memory_error(exc: BaseException) -> bool:
    """An allocation failure at the memory edge: torch's OOM, or cuBLAS / cuDNN / NCCL failing to allocate
    (those come as a plain RuntimeError)."""
    import torch

    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or any(
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


def profiled_step(cfg, ddp, opt, dataset, special, it: int) -> dict:
    """One training step under torch.profiler: device time by kernel category (on the CPU, aten self time),
    the forward+backward and optimizer wall times (synchronised), the heaviest kernels."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from models.megatron.train import run_global_batch

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        _sync()
        t0 = time.perf_counter()
        run_global_batch(cfg, ddp, dataset, special, step=it, noise_step=it)
        _sync()
        t1 = time.perf_counter()
        opt.step()
        _sync()
        t2 = time.perf_counter()
    by_cat: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in prof.events():
        if cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()
        else:
            us = e.self_cpu_time_total
        by_cat[kernel_category(e.name)] = by_cat.get(kernel_category(e.name), 0.0) + us / 1e3
        by_name[e.name] = by_name.get(e.name, 0.0) + us / 1e3
    if cuda and not by_cat:  # no kernel events in this torch's event list: the ops' self device time
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0
            by_cat[kernel_category(e.key)] = by_cat.get(kernel_category(e.key), 0.0) + us / 1e3
            by_name[e.key] = by_name.get(e.key, 0.0) + us / 1e3
    total = sum(by_cat.values()) or 1.0
    return {
        "timed": "cuda kernels" if cuda else "cpu aten self time",
        "forward_backward_ms": 1e3 * (t1 - t0),
        "optimizer_ms": 1e3 * (t2 - t1),
        # device busy / wall: well below 1 means the GPU waits on the host (launches, syncs)
        "busy_share": round(sum(by_cat.values()) / max(1e3 * (t2 - t0), 1e-9), 3) if cuda else None,
        "kernel_ms": {k: round(v, 2) for k, v in sorted(by_cat.items())},
        "share": {k: round(v / total, 3) for k, v in sorted(by_cat.items())},
        "top": [[k[:90], round(v, 2)] for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:10]],
        # which SDPA kernels the step really ran (flash / cuDNN / memory-efficient): the backend, recorded
        "attention_kernels": [
            k[:90] for k, _ in sorted(by_name.items(), key=lambda kv: -kv[1]) if kernel_category(k) == "attention"
        ][:4],
    }


def worker_microbatch(args, p: dict) -> dict:
    """The 1B preset at seq 2048: micro-batches in increasing size until one does not fit (any error on a row
    ends the sweep with that row recorded, the rows before it kept); the MFU of each; one profiled step at the
    largest size; the AR baseline at that size (equal shape). Each row reaches the rows file as measured."""
    import torch

    from models.diffusion.modes import build_objective
    from models.megatron import flops
    from models.megatron.data import build_datasets
    from models.megatron.forward_step import SpecialTokens
    from models.megatron.train import build_training

    manifest = json.loads(Path(args.manifest).read_text())
    vocab = manifest["tokenizer"]["vocab_size"]
    special = SpecialTokens.from_manifest(manifest["tokenizer"])
    cuda = torch.cuda.is_available()
    peak = flops.peak_flops(torch.cuda.get_device_name() if cuda else None)
    rows, best, dataset, profile, kernels = [], None, None, None, None

    def cfg_at(mode: str, mbs: int):
        return config(
            p,
            Path(args.out) / "work",
            p["big"],
            p["big_seq"],
            mode,
            micro_batch_size=mbs,
            global_batch_size=mbs,
            train_iters=1000,
            warmup_iters=10,
        )

    def measure(mode: str, mbs: int, ddp, opt):
        cfg = cfg_at(mode, mbs)
        step_s = _timed_steps(cfg, ddp, opt, dataset, special, p["timed_steps"])
        objective = build_objective(cfg.diffusion)
        step_flops = flops.training_flops(cfg, vocab, [cfg.train.seq_length], mbs, objective=objective)
        eff = flops.efficiency(step_flops, step_s, 1, peak)
        return {
            "mode": mode,
            "micro_batch": mbs,
            "step_s": step_s,
            "tokens_per_s": mbs * cfg.train.seq_length / step_s,
            "tflops": eff["tflops_per_device"],
            "mfu": eff["mfu"],
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        }

    for mode, role in (("difflm-noshift", "sweep"), ("ar", "baseline")):  # sweep sizes, then ar at the best one
        sizes = p["mbs_sizes"] if role == "sweep" else [best["micro_batch"]] if best else []
        if not sizes:
            break
        cfg = cfg_at(mode, max(p["mbs_sizes"]))
        if dataset is None:
            _init(cfg)
            dataset, _ = build_datasets(cfg, manifest, 64 * max(p["mbs_sizes"]), cfg.train.global_batch_size)
        ddp, opt, _ = build_training(cfg, vocab)  # the trainer's kernels (fused AdamW, compiled SwiGLU, ...)
        if kernels is None:
            kernels = run_kernels(cfg, ddp)
            _append_row(args, {"mode": mode, "kernels": kernels})
        for mbs in sizes:
            try:
                row = measure(mode, mbs, ddp, opt)
            except Exception as exc:  # OOM, or cuBLAS/NCCL failing to allocate: this row only
                row = {
                    "mode": mode,
                    "micro_batch": mbs,
                    "oom": memory_error(exc),
                    "error": f"{type(exc).__name__}: {exc}"[:400],
                }
            rows.append(row)  # (outside the handler: the exception's frames no longer hold the activations)
            _append_row(args, row)
            _free()
            if "error" in row:
                break
            if role == "sweep":
                best = row
        if role == "sweep" and best:
            try:
                profile = profiled_step(cfg_at(mode, best["micro_batch"]), ddp, opt, dataset, special, 99)
                profile["micro_batch"] = best["micro_batch"]
            except Exception as exc:
                profile = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            _append_row(args, {"mode": mode, "profile": profile})
            _free()
        del ddp, opt
        _free()
    return microbatch_summary(p, rows, profile, kernels)


def run_kernels(cfg, ddp) -> dict:
    """The kernels the measured steps use, as the trainer logs them (models/megatron/kernels.py), with the SDPA
    kernel picked at this layout (a --sdpa forced around the worker included)."""
    from models.diffusion.modes import objective_class
    from models.megatron.kernels import kernel_settings, sdpa_choice

    param = next(ddp.module.parameters())
    bidirectional = objective_class(cfg.diffusion.model_running_mode).bidirectional
    return {
        **kernel_settings(cfg).describe(),
        "sdpa_kernel": sdpa_choice(cfg, param.device, param.dtype, bidirectional),
    }


def microbatch_summary(p: dict, rows: list[dict], profile: dict | None = None, kernels: dict | None = None) -> dict:
    """The sweep's figures from its rows (also from the rows of a run that was cut short)."""
    profile = profile or next((r["profile"] for r in rows if "profile" in r), None)
    kernels = kernels or next((r["kernels"] for r in rows if "kernels" in r), None)
    rows = [r for r in rows if "kernels" not in r]
    measured = [r for r in rows if "step_s" in r]
    from models.diffusion.modes import objective_class

    causal = [r for r in measured if not objective_class(r["mode"]).bidirectional]  # the AR baseline's rows
    best = next((r for r in reversed(measured) if r not in causal), None)
    ar = next(iter(causal), None)
    both = best and ar and ar["micro_batch"] == best["micro_batch"]
    return {
        "preset": p["big"],
        "seq": p["big_seq"],
        "rows": [r for r in rows if "profile" not in r],
        "largest_micro_batch": best and best["micro_batch"],
        "mfu": best and best["mfu"],
        "ar_mfu": ar and ar["mfu"],
        "tokens_per_s": best and best.get("tokens_per_s"),
        "peak_memory_gb": best and best.get("peak_memory_gb"),
        # bidirectional attention does twice the attention FLOPs of causal: compare throughput in FLOPs
        "difflm_over_ar_tflops": best["tflops"] / ar["tflops"] if both else None,
        "difflm_over_ar_step_time": best["step_s"] / ar["step_s"] if both else None,
        # the sweep pays the optimizer every micro-batch (global batch = micro-batch); real runs accumulate 4+:
        # the MFU of forward+backward alone, from the profiled step's optimizer time
        "mfu_without_optimizer": _without_optimizer(best, profile),
        "profile": profile,
        "kernels": kernels,
    }


def _without_optimizer(best: dict | None, profile: dict | None) -> float | None:
    if not best or best.get("mfu") is None or not profile or "optimizer_ms" not in profile:
        return None
    fwd_bwd = best["step_s"] - profile["optimizer_ms"] / 1e3
    return best["mfu"] * best["step_s"] / fwd_bwd if fwd_bwd > 0 else None


WORKERS = {"logits": worker_logits, "parity": worker_parity, "microbatch": worker_microbatch}


# ---- report ---------------------------------------------------------------------------------------------
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _table(keys: list[str], rows: list[dict]) -> list[str]:
    return [
        "| " + " | ".join(keys) + " |",
        "|" + "---|" * len(keys),
        *["| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in rows],
    ]


def markdown(report: dict) -> str:
    env = report.get("environment") or {}
    lines = [
        f"# GPU check ({'dry run, CPU' if report['dry_run'] else env.get('device', 'GPU')})",
        "",
        f"torch {env.get('torch')} (CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}), megatron-core "
        f"{env.get('megatron_core')}, Transformer Engine: {'yes' if env.get('transformer_engine') else 'no'}; "
        f"from the wheels: {', '.join(env.get('installed_from_wheels') or []) or '-'}; SDPA forced: "
        f"{report.get('sdpa_forced') or 'no'}; {report['seconds']:.0f} s so far. MFU is against the datasheet "
        f"dense bf16 peak (models/megatron/flops.py).",
        "",
        "| section | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {s['status']} | {s['seconds']:.1f} |" for name, s in report["sections"].items()]
    for name, s in report["sections"].items():
        lines += ["", f"## {name}", ""]
        if s["status"] == "ok":
            lines += _section_lines(name, s["result"])
            continue
        if s.get("partial"):
            lines += [f"Figures so far ({s['status']}):", ""] + _section_lines(name, s["partial"]) + [""]
        if s.get("error") or s["status"] != "running":
            lines += ["```", s.get("error", s["status"])[-3000:], "```"]
    return "\n".join(lines) + "\n"


def _section_lines(name: str, r: dict) -> list[str]:
    if name.startswith("train-"):
        keys = ["preset", "seq", "micro_batch", "steps", "steps_logged", "tokens_per_s_per_device"]
        keys += ["tflops_per_device", "mfu", "peak_memory_gb", "loss_first", "loss_last", "val_last", "loss_falling"]
        return _table(keys, [r])
    if name == "microbatch-1b" and "rows" in r:
        keys = ["mode", "micro_batch", "step_s", "tokens_per_s", "tflops", "mfu", "peak_memory_gb", "oom", "error"]
        r = r if "largest_micro_batch" in r else microbatch_summary({"big": "?", "big_seq": "?"}, r["rows"])
        lines = [
            f"Largest micro-batch: {r['largest_micro_batch']}; MFU {_fmt(r['mfu'])} (goal {GOAL_MFU_1B}; "
            f"{_fmt(r.get('mfu_without_optimizer'))} without the optimizer step), "
            f"AR at that size {_fmt(r['ar_mfu'])}; difflm/AR TFLOP/s {_fmt(r['difflm_over_ar_tflops'])} "
            f"(step time {_fmt(r['difflm_over_ar_step_time'])}: bidirectional attention does 2x the attention FLOPs).",
            "",
            *_table(keys, r["rows"]),
        ]
        if r.get("kernels"):
            lines += ["", f"Kernels: `{json.dumps(r['kernels'])}`."]
        prof = r.get("profile")
        if prof and "share" in prof:
            lines += [
                "",
                f"Profiled step at micro-batch {prof.get('micro_batch')} ({prof['timed']}): "
                f"forward+backward {prof['forward_backward_ms']:.1f} ms, optimizer {prof['optimizer_ms']:.1f} ms, "
                f"device busy {_fmt(prof.get('busy_share'))} of the step; attention kernels: "
                f"{', '.join(prof.get('attention_kernels') or []) or '-'}.",
                "",
            ]
            cats = sorted(prof["share"])
            lines += _table(
                ["category", *cats],
                [
                    {"category": "ms", **prof["kernel_ms"]},
                    {"category": "share", **prof["share"]},
                ],
            )
        return lines
    if name == "probe":
        lines = []
        att = r.get("attention") or {}
        keys = ["layout", "chosen", "default_ms", "flash_ms", "cudnn_ms", "efficient_ms", "math_ms", "errors"]
        if att:
            rows = [
                {
                    "layout": k,
                    **v,
                    "errors": "; ".join(f"{e[:-6]}: {t[:80]}" for e, t in v.items() if e.endswith("_error")) or None,
                }
                for k, v in att.items()
            ]
            lines += _table(keys, rows) + [""]
        rest = {k: v for k, v in r.items() if k != "attention"}
        return lines + ["```json", json.dumps(rest, indent=1, default=str), "```"]
    return ["```json", json.dumps(r, indent=1, default=str), "```"]


# ---- main -----------------------------------------------------------------------------------------------
def run_sections(check: Check, args) -> None:
    p, out = check.p, check.out
    manifest_path = out / "data" / "manifest.json"
    state: dict = {}

    def env_section():
        installed = ensure_dependencies(Path(args.wheels), out / ".site")
        import torch

        if not torch.cuda.is_available() and not p["dry"]:
            raise SystemExit("no CUDA device: use --dry-run to exercise the check on the CPU")
        check.report["environment"] = environment(installed)
        return check.report["environment"]

    if check.section("environment", env_section) is None:
        return  # nothing else can run without megatron-core and pydantic
    check.section("probe", lambda: probe(p), 5)
    if check.section("data", lambda: {"tokens": make_dataset(p, out / "data")["splits"]["train"]["tokens"]}) is None:
        return
    check.section("microbatch-1b", lambda: worker(check, "microbatch", manifest_path, name="microbatch-1b"), 45)
    state["difflm"] = check.section(
        "train-difflm", lambda: train(check, "train-difflm", manifest_path, "difflm-noshift"), 45
    )
    if state["difflm"] or (check.only and "export" not in check.only):
        check.section("export", lambda: export(check, manifest_path, state["difflm"]), 30)
    else:
        check.skip("export", "skipped: train-difflm left no checkpoint")
    check.section("spec-parity", lambda: worker(check, "parity", manifest_path, name="spec-parity"), 25)
    check.section("gpu-tests", lambda: gpu_tests(check, "gpu-tests", f"not ({FLEX_TESTS})"), 30)
    check.section("train-ar", lambda: train(check, "train-ar", manifest_path, "ar"), 45)
    check.section("gpu-tests-flex", lambda: gpu_tests(check, "gpu-tests-flex", FLEX_TESTS), 30)


SECTIONS = (
    "environment",
    "probe",
    "data",
    "microbatch-1b",
    "train-difflm",
    "export",
    "spec-parity",
    "gpu-tests",
    "train-ar",
    "gpu-tests-flex",
)
ALWAYS = {"environment", "data"}  # every other section needs the packages; the training ones need the data


def _sections(text: str) -> set[str]:
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(SECTIONS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    return names


def _forced_sdpa(name: str | None):
    """sdpa_kernel([BACKEND]) around a worker (--sdpa / DIFFLM_SDPA_BACKEND), else nothing."""
    import contextlib

    if not name:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name.upper())])


def _interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="report folder (report.md, report.json, logs)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: the same code path, ~2 minutes")
    ap.add_argument("--wheels", default=str(HERE / "gpu_wheels"), help="folder of wheels for missing packages")
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
        help="run only these sections (comma-separated; environment and data always run), e.g. gpu-tests-flex "
        "for a second device call when the first ran out of time",
    )
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    for hidden in ("--manifest", "--result", "--checkpoint", "--config", "--rows"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # inside torchrun
        with _forced_sdpa(args.sdpa):
            result = WORKERS[args.worker](args, plan(args.dry_run))
        if int(os.environ.get("RANK", 0)) == 0:
            Path(args.result).write_text(json.dumps(result, indent=1, default=str))
        return 0
    if not args.out:
        ap.error("give the report folder")
    offline_environment()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    p = plan(args.dry_run)
    check = Check(
        out,
        p,
        args.budget_s if not args.dry_run else float("inf"),
        {"dry_run": args.dry_run, "sdpa_forced": args.sdpa, "argv": sys.argv[1:]},
        args.only,
    )
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
