"""Process-group helpers for code that runs megatron utilities outside torchrun (conversion, tests)."""

from __future__ import annotations

import contextlib
import tempfile

import torch.distributed as dist


@contextlib.contextmanager
def single_process_group():
    """A gloo group of one process (file rendezvous: no port to collide with), unless one exists."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="difflm-pg-") as tmp:  # the store deletes its file itself
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
