"""Make megatron-core's local (non-Transformer-Engine) path run on a CPU-only torch.

megatron-core hard-codes CUDA in places the local spec still reaches (RNG tracker, RoPE buffers,
optimizer/grad-clip asserts, checkpoint exchange). This module routes those to the CPU. It is the one
place that knows about it; it does nothing when CUDA is available. Activate it after
``init_process_group("gloo")`` and before building a model.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer import utils as tutils
from torch.overrides import TorchFunctionMode

_ACTIVE: _CpuDeviceMode | None = None


def _cpu_device(value: Any) -> Any:
    """Map any CUDA device spec (str, int index, torch.device) to 'cpu'; leave other values alone."""
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    return value


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites `device='cuda'`, `.cuda()` and `.to('cuda')` to the CPU, and reports CPU tensors'
    `.type()` under the CUDA name so megatron's `param.grad.type() == 'torch.cuda.FloatTensor'` holds."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_cpu_device(a) for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda") else name
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for a CUDA stream: waits and synchronisations are no-ops on the CPU."""

    def __init__(self, *_, **__):
        pass

    def wait_stream(self, *_):
        pass

    def synchronize(self):
        pass

    def record_event(self, *_):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


def _patch_torch_cuda() -> None:
    cuda: Any = torch.cuda  # replaced members: typed as torch's CUDA API, they are CPU stand-ins here
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *_, **__: None
    cuda.empty_cache = lambda: None
    cuda.current_stream = lambda *_, **__: _NullStream()
    cuda.default_stream = lambda *_, **__: _NullStream()
    cuda.Stream = _NullStream
    cuda.stream = lambda *_: contextlib.nullcontext()
    # megatron's RNG tracker forks "the CUDA generator"; on the CPU that is the default generator.
    cuda.get_rng_state = lambda *_, **__: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *_, **__: torch.set_rng_state(state)
    # Seed the CPU generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))


def _patch_megatron() -> None:
    mrandom._get_cuda_rng_state = lambda *_, **__: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *_, **__: torch.set_rng_state(state)

    def cpu_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()

    tutils.get_default_causal_mask = cpu_causal_mask
    try:  # fused_softmax imports the function by name; guarded: a build may lack the fused kernels
        from megatron.core.fusions import fused_softmax

        fused_softmax.get_default_causal_mask = cpu_causal_mask
    except ImportError:
        pass


def needs_cpu_compat() -> bool:
    return not torch.cuda.is_available()


def activate() -> bool:
    """Install the CPU routing once; returns True when it is active (False on a CUDA machine)."""
    global _ACTIVE
    if not needs_cpu_compat():
        return False
    if _ACTIVE is None:
        _patch_torch_cuda()
        _patch_megatron()
        _ACTIVE = _CpuDeviceMode()
        _ACTIVE.__enter__()
    return True
