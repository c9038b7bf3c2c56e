"""Will the model fit: its parameter and optimizer bytes from the config, before anything is built.

A model too big for the machine used to fail inside the allocator with a long traceback, after data prep and a
trainer start. The estimate counts only what training must hold whatever the batch (weights, gradients, Adam's
two moments, bf16's fp32 main weights) and leaves out activations and the time embedding: it is a lower bound,
so a refusal is never wrong, and a model that passes can still run short on activations.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from difflm.config import PipelineConfig
from difflm.errors import UserError

GRAD_BYTES = 4  # megatron's DDP reduces gradients in fp32 (grad_reduce_in_fp32)
ADAM_BYTES = 8  # exp_avg and exp_avg_sq, fp32


class ModelTooBig(UserError, MemoryError):
    """The model's weights and optimizer state alone exceed the memory it would train in."""


def parameter_count(cfg: PipelineConfig) -> int:
    """Parameters of the transformer and its embeddings (vocabulary: the BPE's configured size when the
    tokenizer is trained, else none counted: a lower bound; the time embedding and biases aside)."""
    m, arch = cfg.model, cfg.model.arch
    h, heads = m.hidden_size, m.num_attention_heads
    head_dim = arch.head_width(h, heads)
    groups = m.num_query_groups or heads
    attention = h * head_dim * (heads + 2 * groups) + heads * head_dim * h
    mlp = arch.mlp_matrices * h * m.ffn_size
    trains_bpe = not (cfg.tokenizer.path or cfg.train.init_from_hf or cfg.train.init_from)  # else unknown here
    vocab = cfg.tokenizer.vocab_size if trains_bpe else 0
    embeddings = vocab * h * (1 if m.tie_embeddings else 2)
    return m.num_layers * (attention + mlp + 2 * h) + h + embeddings


def training_bytes(cfg: PipelineConfig) -> tuple[int, int]:
    """(parameters, bytes one device holds for them in training): weights, fp32 gradients and Adam state, the
    model cut in tensor x pipeline parallel parts, the optimizer state also in data-parallel ones when
    distributed."""
    p = cfg.parallel
    parts = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    data_parallel = max(1, cfg.train.launch.nproc_per_node // parts)
    weights = 2 if cfg.train.precision == "bf16" else 4
    optimizer: float = ADAM_BYTES + (4 if cfg.train.precision == "bf16" else 0)  # bf16 keeps fp32 main weights
    if p.use_distributed_optimizer:
        optimizer /= data_parallel
    count = parameter_count(cfg)
    return count, int(count / parts * (weights + GRAD_BYTES + optimizer))


def gpu_memory() -> int | None:
    """Bytes of the smallest visible GPU (nvidia-smi), None without one. nvidia-smi, not torch: the check runs in
    the command line process before torch is imported."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" or not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = [int(x) * 2**20 for x in out.split() if x.strip().isdigit()]
    return min(sizes) if sizes else None


def host_memory() -> int:
    """Bytes of memory available to new processes (MemAvailable), else the machine's total."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def check_fits(cfg: PipelineConfig, gpu_bytes: int | None = None, host_bytes: int | None = None) -> None:
    """Refuse (ModelTooBig) a locally trained model whose weights and optimizer state exceed one GPU's memory, or,
    on the CPU, the host's available memory shared by every rank. Cluster launches train elsewhere: not checked."""
    if cfg.train.launch.launcher != "local":
        return
    count, per_device = training_bytes(cfg)
    gpu = gpu_bytes if gpu_bytes is not None else gpu_memory()
    if gpu:
        need, have, where = per_device, gpu, "one GPU's memory"
    else:
        need = per_device * cfg.train.launch.nproc_per_node  # every rank in this host's memory
        have, where = host_bytes if host_bytes is not None else host_memory(), "available host memory"
    if need > have:
        raise ModelTooBig(
            f"the model does not fit: {count:,} parameters need at least {human(need)} for weights, gradients and "
            f"Adam state, and {where} is {human(have)}; make it smaller (model.hidden_size={cfg.model.hidden_size}, "
            f"model.num_layers={cfg.model.num_layers}) or split it (parallel.tensor_model_parallel_size, "
            f"parallel.pipeline_model_parallel_size)"
        )
