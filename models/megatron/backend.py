"""Optional heavy dependencies of the model stack, guarded in one place.

Transformer Engine is a GPU-only extra (`pip install 'difflm-pipeline[gpu]'`). Without it, or without
CUDA, models use megatron-core's local spec (and, on the CPU, `models.megatron.compat`).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def transformer_engine_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # the PyPI meta package imports but raises; a broken CUDA install raises too
        return False
    return True


def resolve_backend(requested: str) -> str:
    """'auto' -> 'te' on CUDA with Transformer Engine installed, else 'local'. Errors say what to install."""
    if requested == "local":
        return "local"
    te_ok = torch.cuda.is_available() and transformer_engine_available()
    if requested == "te" and not te_ok:
        raise RuntimeError(
            "model backend 'te' needs CUDA and Transformer Engine: pip install 'difflm-pipeline[gpu]' "
            "on a GPU machine, or set model.backend=local"
        )
    return "te" if te_ok else "local"
