"""The kernels a run uses without Transformer Engine or apex, decided in one place and logged once.

On CUDA, with `model.fusions=auto`:
- SwiGLU: megatron's `bias_swiglu_impl` (`bias_activation_fusion`): the same function, compiled by megatron's
  `jit_fuser` (torch.compile), so the MLP's elementwise passes become one kernel and its input alone is saved.
- cross-entropy: megatron's native fused vocab-parallel cross-entropy (`cross_entropy_fusion_impl='native'`),
  bf16 only: its backward casts the logits' gradient to bf16. Our objectives weight megatron's per-token
  cross-entropy [b, s] afterwards (models/diffusion/modes.py), so the fusion applies to every objective that
  passes labels; `full_logits` objectives (uniform diffusion) keep their own torch loss.
- AdamW: torch's `fused=True` kernel instead of the foreach default megatron builds without apex / TE.
- RoPE: unfused. megatron's `apply_rope_fusion` is Transformer Engine's kernel only; what megatron-core offers
  without it is its `RotaryEmbedding` table, cached per sequence length (`lru_cache`), which is in use.
  `model.compile=rope` compiles the rotation, `model.compile=layers` every layer whole (models/megatron/compiled.py);
  both off by default until a GPU measures them faster (benchmarks/gpu_check.py's mfu-knobs section), as is
  `model.cuda_graphs=layers` (megatron's per-layer CUDA graphs: a small model's launch overhead; CUDA only).
The CPU keeps the reference path: the compiles cost ~16 s per process there (measured) for no gain at test sizes.

The attention kernel of the torch backend is PyTorch's SDPA choice (flash / cuDNN / memory-efficient), or the one
`model.sdpa_backend` forces around the forward and backward (`sdpa_context`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
from dataclasses import asdict, dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from difflm.config import PipelineConfig
from difflm.errors import UserError
from difflm.models.diffusion.arch import ModelArch

SDPA = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
ROPE = "unfused (cos/sin table cached per length; megatron's fused RoPE needs Transformer Engine)"


@dataclass(frozen=True)
class Kernels:
    swiglu_fusion: bool
    cross_entropy_fusion: bool
    fused_adam: bool
    sdpa_backend: str  # as configured: auto or a forced kernel
    rope: str = ROPE
    compile_unavailable: str | None = None  # why the compiled fusions are off on this CUDA machine, if they are
    compile: str = "off"  # model.compile: torch.compile of RoPE or of whole layers (models/megatron/compiled.py)
    recompute: str = "off"  # model.recompute: megatron's activation recompute
    cuda_graphs: str = "off"  # model.cuda_graphs: megatron's per-layer CUDA graphs

    def describe(self) -> dict:
        return asdict(self)


@functools.cache
def compiler_missing() -> str | None:
    """Why torch.compile could not build CUDA kernels here (None: it can): Triton, and a C compiler for the
    launcher Triton builds. Checked up front so that a GPU image without them trains unfused instead of failing
    in its first forward."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not any(os.environ.get("CC") or shutil.which(cc) for cc in ("gcc", "cc", "clang")):
        return "no C compiler (Triton builds its kernel launcher with one)"
    return None


def kernel_settings(cfg: PipelineConfig, cuda: bool | None = None, compiler_ok: bool | None = None) -> Kernels:
    cuda = torch.cuda.is_available() if cuda is None else cuda
    on = cuda and cfg.model.fusions == "auto"
    missing = None if compiler_ok or not on else compiler_missing()
    compiled = on and missing is None  # megatron's jit_fuser is torch.compile
    arch = ModelArch.of(cfg.model)
    return Kernels(
        # megatron's compiled SwiGLU is exact; its GeGLU kernel is the tanh approximation whatever the activation
        # (and takes no partial), and its plain GELU one needs MLP biases: only SwiGLU is fused
        swiglu_fusion=compiled and arch.gated_mlp and arch.activation == "silu",
        cross_entropy_fusion=compiled and cfg.train.precision == "bf16",
        fused_adam=on,
        sdpa_backend=cfg.model.sdpa_backend,
        compile_unavailable=missing,
        compile=cfg.model.compile,
        recompute=cfg.model.recompute,
        cuda_graphs=cfg.model.cuda_graphs,
    )


def check_cuda_graphs(setting: str, cuda: bool | None = None) -> None:
    """CUDA graphs capture CUDA kernels: refused in one line where there is no CUDA device (the CLI checks it
    before a local run starts, flows/prechecks.py; the trainer again before it builds the model)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if setting != "off" and not cuda:
        raise UserError(
            f"model.cuda_graphs={setting} captures CUDA kernels and this machine has no CUDA device: "
            "set model.cuda_graphs=off"
        )


def check_sdpa(name: str, backend: str, cuda: bool | None = None) -> None:
    """A forced SDPA kernel needs the torch backend, and all but `math` need CUDA: say so before building."""
    if name == "auto":
        return
    if backend != "torch":
        raise RuntimeError(
            f"model.sdpa_backend={name} forces PyTorch's SDPA kernel, which only model.backend=torch uses "
            f"(this run resolved to {backend!r}): set model.backend=torch or model.sdpa_backend=auto"
        )
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if name != "math" and not cuda:
        raise RuntimeError(
            f"model.sdpa_backend={name} is a CUDA kernel: on the CPU use model.sdpa_backend=auto or math"
        )


def sdpa_context(name: str):
    """sdpa_kernel([that kernel]) for a forced `model.sdpa_backend`, else nothing (PyTorch's own choice)."""
    if name == "auto":
        return contextlib.nullcontext()
    return sdpa_kernel([getattr(SDPBackend, SDPA[name])])


def sdpa_choice(cfg: PipelineConfig, device: torch.device, dtype: torch.dtype, bidirectional: bool) -> str:
    """The kernel SDPA picks for one layer of this model at the configured length (no attention is computed):
    `torch._fused_sdp_choice` on empty q, k, v of the layout megatron hands to the torch backend."""
    m = cfg.model
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    head_dim = ModelArch.of(m).head_width(m.hidden_size, heads)
    s, b = cfg.train.seq_length, cfg.train.micro_batch_size
    q = torch.empty(b, heads, s, head_dim, device=device, dtype=dtype)
    k = v = torch.empty(b, groups, s, head_dim, device=device, dtype=dtype)
    names = {v.value: n for n, v in SDPBackend.__members__.items()}
    try:
        with sdpa_context(m.sdpa_backend):
            choice = torch._fused_sdp_choice(q, k, v, is_causal=not bidirectional, enable_gqa=groups != heads)
    except Exception as exc:  # a forced kernel that cannot take this layout: the first forward would fail too
        return f"error: {type(exc).__name__}: {exc}"[:200]
    return names.get(int(choice), str(choice))


def torch_optimizers(opt) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's wrapper (one, or one per chained optimizer)."""
    parts = getattr(opt, "chained_optimizers", None) or [opt]
    return [o.optimizer for o in parts if isinstance(getattr(o, "optimizer", None), torch.optim.Optimizer)]


def use_fused_adam(opt, fused: bool) -> None:
    """Choose torch Adam's kernel after megatron built it (its fallback passes neither `fused` nor `foreach`): the
    choice is per param group and read at every step. Fused keeps its `step` counts on the parameters' device
    as float32, so counts a checkpoint load restored on the CPU are moved there (call again after a load)."""
    for inner in torch_optimizers(opt):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            # (None, None): torch's default, foreach where supported, as megatron built it; a checkpoint's
            # param groups carry the saving run's choice, hence the reset
            group["fused"], group["foreach"] = (True, False) if fused else (None, None)
        if not fused:
            continue
        for param, state in inner.state.items():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and (step.device != param.device or step.dtype != torch.float32):
                state["step"] = step.to(device=param.device, dtype=torch.float32)
