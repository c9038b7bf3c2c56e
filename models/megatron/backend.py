"""Optional heavy dependencies of the model stack, guarded in one place, and the choice of layer spec.

Transformer Engine is a GPU-only extra (`pip install 'difflm-pipeline[gpu]'`). Without it a GPU runs the
`torch` spec (megatron-core layers, PyTorch's flash / cuDNN attention, see `difflm.models.megatron.attention`);
the CPU runs the `torch` spec too (through `difflm.models.megatron.compat`): it gives megatron-core's `local` reference
spec's logits (tests/gpu/test_gpu.py, ~1e-7) and trains faster there (docs/benchmarks.md); `local` stays selectable.
"""

from __future__ import annotations

import functools

import torch

BACKENDS = ("torch", "local", "te")


@functools.cache
def transformer_engine_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401  # optional back-end: probed, not required
    except Exception:  # the PyPI meta package imports but raises; a broken CUDA install raises too
        return False
    return True


def resolve_backend(requested: str, two_stream: bool = False) -> str:
    """'auto' -> 'te' on CUDA with Transformer Engine, else 'torch' (the CPU included: SDPA matches the local
    spec's unfused softmax and is faster and leaner there).
    An explicit choice is kept; 'te' without its requirements is an error that says what to install.
    `two_stream` (block diffusion's [x_t | x_0] mask, which TE cannot take): 'auto' never picks 'te'."""
    if requested in ("torch", "local"):
        return requested
    cuda = torch.cuda.is_available()
    te_ok = cuda and transformer_engine_available() and not (two_stream and requested == "auto")
    if requested == "te" and not te_ok:
        raise RuntimeError(
            "model backend 'te' needs CUDA and Transformer Engine: pip install 'difflm-pipeline[gpu]' "
            "on a GPU machine, or set model.backend=torch (PyTorch's fused attention, no extra install)"
        )
    if te_ok:
        return "te"
    return "torch"
