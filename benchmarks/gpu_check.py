"""One-shot GPU check: everything that needs a GPU, in one run, with a markdown + JSON report.

    python benchmarks/gpu_check.py REPORT_DIR              # on one H100/H200-class GPU: about 6-8 minutes
    python benchmarks/gpu_check.py REPORT_DIR --dry-run    # the same code path on the CPU at a tiny size

It runs in a bare, offline CUDA environment that has only Python, PyTorch, transformers, safetensors,
tokenizers, numpy, pyyaml and pytest: megatron-core and pydantic are installed from the wheels that
`benchmarks/gpu_wheels.py` downloads beforehand into `benchmarks/gpu_wheels/` (no network, no Transformer
Engine: the default GPU backend is then `torch`, megatron-core's layers on PyTorch's flash attention). It
imports only the trainer and the HF export (no Prefect, MLflow or datatrove) and makes its own data: a
pre-tokenised synthetic corpus from a sparse Markov chain (4 successors per token), so that the loss has
somewhere to fall (its entropy is log 4 = 1.39 nats/token) and a sample can be judged by how many of its
token pairs the chain allows.

Sections, each timed and reported even when another fails:
  gpu-tests       the `gpu`-marked tests (tests/test_gpu.py, tests/test_hf_device.py)
  train-difflm    ~300 steps of the 350M preset in bf16, masked diffusion: tokens/s, MFU, peak memory, loss
  train-ar        the same for the autoregressive baseline
  spec-parity     first-step loss of the torch spec against megatron's local spec on the same weights and batch
  export          the trained difflm checkpoint -> HF folder, loaded in fp32 and bf16 on the GPU: logits
                  against megatron's, ELBO, and a sample
  microbatch-1b   the largest micro-batch of the 1B preset at seq 2048 that fits, its MFU, and the
                  difflm / ar step-time ratio at that shape
The test suite runs `--dry-run`, so this script cannot rot.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NEEDED = {"megatron.core": "megatron-core", "pydantic": "pydantic"}
GOAL_MFU_1B = 0.45
GOAL_RATIO = 1.05


# ---- environment --------------------------------------------------------------------------------------
def ensure_dependencies(wheels: Path, site: Path) -> list[str]:
    """Install what the bare GPU image lacks from local wheels (no index, no network) into `site`."""
    missing = [pkg for mod, pkg in NEEDED.items() if importlib.util.find_spec(mod) is None]
    if missing:
        if not wheels.is_dir() or not any(wheels.glob("*.whl")):
            raise SystemExit(
                f"missing {', '.join(missing)} and no wheels in {wheels}: run "
                f"`python benchmarks/gpu_wheels.py` on a machine with network access first"
            )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-index",
                "--no-deps",
                "--find-links",
                str(wheels),
                "--target",
                str(site),
                *[str(w) for w in wheels.glob("*.whl")],
            ],
            check=True,
        )
        sys.path.insert(0, str(site))
        importlib.invalidate_caches()
    paths = [str(ROOT), *([str(site)] if missing else []), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return missing


def environment() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    megatron = importlib.import_module("megatron.core.package_info")
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "memory_gb": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "megatron_core": megatron.__version__,
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
    }


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
        }
    return {
        "dry": False,
        "vocab": 32768,
        "documents": 1500,
        "doc_len": 4000,
        "small": "350m",
        "seq": 2048,
        "mbs": 8,
        "steps": 300,
        "precision": "bf16",
        "big": "1b",
        "big_seq": 2048,
        "mbs_sizes": [4, 8, 12, 16, 24, 32, 48],
        "timed_steps": 4,
        "parity_mbs": 2,
        "sample_len": 128,
        "timeout": 420,
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
def torchrun(args: list[str], log: Path, timeout: int) -> None:
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
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(
            f"exit {proc.returncode}; last lines of {log}:\n" + "".join(log.read_text().splitlines(True)[-25:])
        )


def save(cfg, path: Path) -> Path:
    from difflm.config import save_config

    return save_config(cfg, path)


# ---- sections -------------------------------------------------------------------------------------------
def gpu_tests(p: dict, out: Path) -> dict:
    files = [f for f in ("tests/test_gpu.py", "tests/test_hf_device.py") if (ROOT / f).exists()]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=p["timeout"],
    )
    (out / "gpu-tests.log").write_text(proc.stdout + proc.stderr)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode not in (0, 5):  # 5: nothing selected
        raise RuntimeError(f"gpu tests failed: {summary}")
    return {"summary": summary}


def train(p: dict, out: Path, manifest: Path, mode: str) -> dict:
    cfg = config(p, out / "work", p["small"], p["seq"], mode)
    run_dir = out / f"run-{mode}"
    cfg_path = save(cfg, out / f"config-{mode}.yaml")
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
        p["timeout"],
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if r.get("loss") is not None]
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    steady = logged[1:] or logged  # the first interval includes compilation and warm-up

    def mean(key):
        return sum(r[key] for r in steady if r.get(key) is not None) / max(
            sum(r.get(key) is not None for r in steady), 1
        )

    return {
        "mode": mode,
        "preset": p["small"],
        "seq": p["seq"],
        "micro_batch": p["mbs"],
        "steps": p["steps"],
        "loss_first": logged[0]["loss"],
        "loss_last": logged[-1]["loss"],
        "val_first": vals[0] if vals else None,
        "val_last": vals[-1] if vals else None,
        "loss_falling": logged[-1]["loss"] < logged[0]["loss"],
        "tokens_per_s_per_device": mean("tokens_per_s_per_device"),
        "tflops_per_device": mean("tflops_per_device"),
        "mfu": mean("mfu") if any(r.get("mfu") is not None for r in steady) else None,
        "peak_memory_gb": max((r.get("peak_memory_gb") or 0) for r in rows) or None,
        "run_dir": str(run_dir),
    }


def worker(kind: str, p: dict, out: Path, manifest: Path, **extra) -> dict:
    """Run this script's `--worker KIND` under torchrun; returns the JSON it writes."""
    result = out / f"{kind}.json"
    cmd = [
        str(Path(__file__).resolve()),
        str(out),
        "--worker",
        kind,
        "--manifest",
        str(manifest),
        "--result",
        str(result),
        *(["--dry-run"] if p["dry"] else []),
    ]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    torchrun(cmd, out / f"{kind}.log", p["timeout"])
    return json.loads(result.read_text())


def export(p: dict, out: Path, manifest: Path, trained: dict) -> dict:
    """Megatron logits of the trained checkpoint (worker) against the HF export in fp32 and bf16 on the GPU."""
    import numpy as np
    import torch

    from difflm.config import load_config
    from difflm.rundir import RunDir
    from models.hf.convert import export_hf, load_hf

    run = RunDir(trained["run_dir"])
    cfg = load_config(str(out / "config-difflm-noshift.yaml"))
    ckpt = run.checkpoint(run.latest_iteration())
    ref = worker("logits", p, out, manifest, checkpoint=ckpt, config=out / "config-difflm-noshift.yaml")
    man = json.loads(manifest.read_text())
    folder = export_hf(cfg, man["tokenizer"], ckpt, out / "hf")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = torch.load(ref["batch"])
    tokens, megatron_logits = batch["tokens"].to(device), batch["logits"].to(device)
    vocab = man["tokenizer"]["vocab_size"]
    report = {"checkpoint": str(ckpt), "folder": str(folder)}
    table = np.load(Path(man["dir"]) / "markov.npy")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = load_hf(folder).to(device=device, dtype=dtype)
        with torch.no_grad():
            logits = model(tokens).logits.float()[..., :vocab]
        ref_logits = megatron_logits[..., :vocab]
        diff = (logits - ref_logits).abs()
        top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        nll = model.elbo_nll(tokens[:2], t_samples=4)
        nll = float(nll.float().mean()) if torch.is_tensor(nll) else float(nll)
        prompt = tokens[:1, :8]
        with torch.no_grad():
            gen = model.diffusion_generate(prompt, length=p["sample_len"], steps=p["sample_len"])
        sample = gen[0, prompt.shape[1] :].tolist()
        report[name] = {
            "max_abs_diff": diff.max().item(),
            "mean_abs_diff": diff.mean().item(),
            "top1_agreement": top1,
            "elbo_nll": nll,
            "sample_chain_fraction": chain_fraction(sample, table),
            "sample": " ".join(f"w{t}" if t >= len(SPECIALS) else SPECIALS[t] for t in sample[:24]),
        }
        del model
    report["chance_chain_fraction"] = SUCCESSORS / (vocab - len(SPECIALS))
    report["fp32_parity_ok"] = report["fp32"]["max_abs_diff"] < 1e-3 * max(1.0, megatron_logits.abs().max().item())
    report["bf16_parity_ok"] = report["bf16"]["top1_agreement"] > 0.9
    return report


# ---- workers (run under torchrun, one process) ------------------------------------------------------------
def _init(cfg):
    from models.megatron.train import init_distributed

    init_distributed(cfg)


def worker_logits(args, p: dict) -> dict:
    """Megatron's fp32 logits of a checkpoint on a fixed validation batch (the export's reference)."""
    import torch

    from difflm.config import load_config
    from models.megatron import checkpointing
    from models.megatron.data import build_datasets
    from models.megatron.gpt import build_model

    cfg = load_config(args.config, ["train.precision=fp32"])
    manifest = json.loads(Path(args.manifest).read_text())
    _init(cfg)
    _, valid = build_datasets(cfg, manifest, cfg.train.global_batch_size, 4 * cfg.train.global_batch_size)
    tokens = torch.stack([valid[i]["tokens"][: min(256, cfg.train.seq_length)] for i in range(2)])
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
    torch.save({"tokens": tokens, "logits": logits}, path)
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
            out[f"{backend}-{precision}"] = run_global_batch(cfg, ddp, train_ds, special, 0, 0, False)
            del ddp
            _free()
    out["fp32_rel_diff"] = abs(out["torch-fp32"] - out["local-fp32"]) / abs(out["local-fp32"])
    out["bf16_rel_diff"] = abs(out["torch-bf16"] - out["local-bf16"]) / abs(out["local-bf16"])
    return out


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _timed_steps(cfg, ddp, opt, dataset, special, steps: int, warmup: int = 1) -> float:
    """Seconds per training step (forward, backward, optimizer) after `warmup` steps."""
    import torch

    from models.megatron.train import run_global_batch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            tic = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        run_global_batch(cfg, ddp, dataset, special, i, i, False)
        opt.step()
    sync()
    return (time.perf_counter() - tic) / steps


def worker_microbatch(args, p: dict) -> dict:
    """The 1B preset at seq 2048: micro-batches in increasing size until one does not fit; the MFU of each;
    then the AR baseline at the largest size that fitted (equal shape) for the step-time ratio."""
    import torch

    from models.megatron import flops
    from models.megatron.data import build_datasets
    from models.megatron.forward_step import SpecialTokens
    from models.megatron.train import build_training

    manifest = json.loads(Path(args.manifest).read_text())
    vocab = manifest["tokenizer"]["vocab_size"]
    special = SpecialTokens.from_manifest(manifest["tokenizer"])
    cuda = torch.cuda.is_available()
    peak = flops.peak_flops(torch.cuda.get_device_name() if cuda else None)
    rows, best, dataset = [], None, None

    def measure(mode: str, mbs: int, ddp=None, opt=None):
        cfg = config(
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
        step_s = _timed_steps(cfg, ddp, opt, dataset, special, p["timed_steps"])
        step_flops = flops.training_flops(cfg, vocab, [cfg.train.seq_length], mbs)
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

    ar = None
    for mode, role in (("difflm-noshift", "sweep"), ("ar", "baseline")):  # sweep sizes, then ar at the best one
        cfg = config(
            p,
            Path(args.out) / "work",
            p["big"],
            p["big_seq"],
            mode,
            micro_batch_size=max(p["mbs_sizes"]),
            global_batch_size=max(p["mbs_sizes"]),
            train_iters=1000,
            warmup_iters=10,
        )
        if dataset is None:
            _init(cfg)
            dataset, _ = build_datasets(cfg, manifest, 64 * max(p["mbs_sizes"]), cfg.train.global_batch_size)
        ddp, opt, _ = build_training(cfg, vocab)
        sizes = p["mbs_sizes"] if role == "sweep" else [best["micro_batch"]] if best else []
        for mbs in sizes:
            try:
                row = measure(mode, mbs, ddp, opt)
            except torch.OutOfMemoryError:
                row = {"mode": mode, "micro_batch": mbs, "oom": True}
            rows.append(row)  # (outside the handler: the exception's frames no longer hold the activations)
            _free()
            if row.get("oom"):
                break
            if role == "sweep":
                best = row
            else:
                ar = row
        del ddp, opt
        _free()
    return {
        "preset": p["big"],
        "seq": p["big_seq"],
        "rows": rows,
        "largest_micro_batch": best and best["micro_batch"],
        "mfu": best and best["mfu"],
        "difflm_over_ar": best["step_s"] / ar["step_s"] if best and ar else None,
    }


WORKERS = {"logits": worker_logits, "parity": worker_parity, "microbatch": worker_microbatch}


# ---- report ---------------------------------------------------------------------------------------------
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"# GPU check ({'dry run, CPU' if report['dry_run'] else env.get('device')})",
        "",
        f"torch {env.get('torch')} (CUDA {env.get('cuda')}), megatron-core {env.get('megatron_core')}, "
        f"Transformer Engine: {'yes' if env.get('transformer_engine') else 'no'}; "
        f"total {report['seconds']:.0f} s. MFU is against the datasheet dense bf16 peak "
        f"(models/megatron/flops.py).",
        "",
        "| section | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {s['status']} | {s['seconds']:.1f} |" for name, s in report["sections"].items()]
    for name, s in report["sections"].items():
        lines += ["", f"## {name}", ""]
        if s["status"] != "ok":
            lines += ["```", s.get("error", s["status"])[-3000:], "```"]
            continue
        lines += _section_lines(name, s["result"])
    return "\n".join(lines) + "\n"


def _section_lines(name: str, r: dict) -> list[str]:
    if name.startswith("train-"):
        keys = [
            "preset",
            "seq",
            "micro_batch",
            "steps",
            "tokens_per_s_per_device",
            "tflops_per_device",
            "mfu",
            "peak_memory_gb",
            "loss_first",
            "loss_last",
            "val_first",
            "val_last",
            "loss_falling",
        ]
        return [
            "| " + " | ".join(keys) + " |",
            "|" + "---|" * len(keys),
            "| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |",
        ]
    if name == "microbatch-1b":
        keys = ["mode", "micro_batch", "step_s", "tokens_per_s", "tflops", "mfu", "peak_memory_gb", "oom"]
        return [
            f"Largest micro-batch: {r['largest_micro_batch']}; MFU {_fmt(r['mfu'])} (goal {GOAL_MFU_1B}); "
            f"difflm / ar step time {_fmt(r['difflm_over_ar'])} (goal <= {GOAL_RATIO}).",
            "",
            "| " + " | ".join(keys) + " |",
            "|" + "---|" * len(keys),
            *["| " + " | ".join(_fmt(row.get(k)) for k in keys) + " |" for row in r["rows"]],
        ]
    return ["```json", json.dumps(r, indent=1, default=str), "```"]


# ---- main -----------------------------------------------------------------------------------------------
def run_sections(p: dict, out: Path, budget_s: float) -> dict:
    started = time.time()
    sections: dict = {}
    state: dict = {}

    def section(name: str, fn, need_s: float = 0):
        left = budget_s - (time.time() - started)
        if left < need_s:
            sections[name] = {"status": f"skipped: {left:.0f} s of the time budget left", "seconds": 0.0}
            print(f"[gpu-check] {name}: skipped (time budget)", flush=True)
            return None
        tic = time.time()
        print(f"[gpu-check] {name} ...", flush=True)
        try:
            result = fn()
            sections[name] = {"status": "ok", "seconds": time.time() - tic, "result": result}
        except Exception:  # a failed section is reported; the others still run
            sections[name] = {"status": "failed", "seconds": time.time() - tic, "error": traceback.format_exc()}
            result = None
        print(f"[gpu-check] {name}: {sections[name]['status']} in {sections[name]['seconds']:.1f} s", flush=True)
        return result

    manifest_path = out / "data" / "manifest.json"
    section("data", lambda: {"tokens": make_dataset(p, out / "data")["splits"]["train"]["tokens"]})
    section("gpu-tests", lambda: gpu_tests(p, out), 30)
    state["difflm"] = section("train-difflm", lambda: train(p, out, manifest_path, "difflm-noshift"), 60)
    section("microbatch-1b", lambda: worker("microbatch", p, out, manifest_path), 60)
    section("train-ar", lambda: train(p, out, manifest_path, "ar"), 60)
    if state["difflm"]:
        section("export", lambda: export(p, out, manifest_path, state["difflm"]), 30)
    section("spec-parity", lambda: worker("parity", p, out, manifest_path), 20)
    return sections


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="report folder (report.md, report.json, logs)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: the same code path, ~2 minutes")
    ap.add_argument("--wheels", default=str(HERE / "gpu_wheels"), help="folder of wheels for missing packages")
    ap.add_argument("--budget-s", type=float, default=450, help="skip sections that would not fit in this many seconds")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    for hidden in ("--manifest", "--result", "--checkpoint", "--config"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # inside torchrun
        result = WORKERS[args.worker](args, plan(args.dry_run))
        if int(os.environ.get("RANK", 0)) == 0:
            Path(args.result).write_text(json.dumps(result, indent=1, default=str))
        return 0
    if not args.out:
        ap.error("give the report folder")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tic = time.time()
    installed = ensure_dependencies(Path(args.wheels), out / ".site")
    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        ap.error("no CUDA device: use --dry-run to exercise the check on the CPU")
    p = plan(args.dry_run)
    report = {"dry_run": args.dry_run, "installed_from_wheels": installed, "environment": environment(), "plan": p}
    report["sections"] = run_sections(p, out, args.budget_s if not args.dry_run else float("inf"))
    report["seconds"] = time.time() - tic
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(markdown(report))
    print((out / "report.md").read_text())
    failed = [n for n, s in report["sections"].items() if s["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":  # dist_checkpointing spawns helpers: the guard is required
    sys.exit(main())
