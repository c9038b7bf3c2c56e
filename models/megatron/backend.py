"""Optional heavy dependencies of the model stack, guarded in one place, and the choice of layer spec.

Transformer Engine is a GPU-only extra (`pip install 'difflm-pipeline[gpu]'`). Without it a GPU runs the
`torch` spec (megatron-core layers, PyTorch's flash / cuDNN attention, see `models.megatron.attention`);
the CPU runs megatron-core's `local` reference spec (through `models.megatron.compat`) unless asked otherwise.
"""

from __future__ import annotations

import functools

import torch

BACKENDS = ("torch", "local", "te")


@functools.cache
def transformer_engine_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # the PyPI meta package imports but raises; a broken CUDA install raises too
        return False
    return True


def resolve_backend(requested: str, two_stream: bool = False) -> str:
    """'auto' -> 'te' on CUDA with Transformer Engine, 'torch' on CUDA without it, 'local' on the CPU.
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
    return "torch" if cuda else "local"
