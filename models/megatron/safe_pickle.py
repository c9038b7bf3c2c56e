"""Reading a torch distributed checkpoint without running code from it.

torch DCP stores a checkpoint's index (`<ckpt>/.metadata`) as a pickle and reads it with a plain `pickle.load`
(torch/distributed/checkpoint/filesystem.py), so a crafted folder runs any command the moment it is opened
(`difflm convert`, `train.init_from`, a resume, evaluate-latest). `guard_dcp()` makes DCP read it through an
unpickler that builds only what DCP metadata consists of (its dataclasses and enums, torch.Size, dtypes,
layouts); anything else is refused with `UnsafeCheckpoint` before it is built. Megatron's `common.pt` goes
through `torch.load`, weights-only by default since torch 2.6; `check_common` reads it so first, to refuse a
crafted one in one line rather than torch's page of advice; the RNG files are loaded with weights_only=True.
"""

from __future__ import annotations

import enum
import importlib
import io
import pickle
import types
from pathlib import Path

import torch
from torch.distributed.checkpoint import filesystem

from difflm.errors import UserError

# modules whose own classes (dataclasses, enums) make up DCP metadata
_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout from its name
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class UnsafeCheckpoint(UserError, pickle.UnpicklingError):
    """A checkpoint's metadata asks to build something that is not checkpoint metadata (possibly code)."""


def _enum_member(cls, name):
    """`getattr` as some Pythons pickle an enum member (3.11.0-3.11.3 and 3.12+ may write `getattr(Enum, name)`):
    only a member of an enum class the unpickler already allowed, by its name; any other attribute lookup (a way to
    reach functions and modules from a harmless class) is refused."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise UnsafeCheckpoint(
        f"a checkpoint's .metadata asks for attribute {name!r} of {cls!r}, which is not a member of a checkpoint "
        f"enum: refused without running it (it may be crafted to run code); load only checkpoints you trust"
    )


class _MetadataUnpickler(pickle.Unpickler):
    source = "a checkpoint's .metadata"

    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        allowed = (module, name) in _ALLOWED
        if not allowed and module == "torch":
            allowed = isinstance(getattr(torch, name, None), torch.dtype | torch.layout)
        if not allowed and module in _DCP_MODULES and "." not in name:
            obj = getattr(importlib.import_module(module), name, None)
            allowed = isinstance(obj, type) and obj.__module__ == module
        if not allowed:
            raise UnsafeCheckpoint(
                f"{self.source} asks to load {module}.{name}, which is not part of checkpoint metadata: refused "
                f"without running it. The folder was not written by torch distributed checkpointing (it may be "
                f"crafted to run code): load only checkpoints you trust, or rewrite this one from a trusted copy"
            )
        return super().find_class(module, name)


def restricted_load(file, source: str | None = None):
    """`pickle.load` that builds only DCP metadata objects (raises UnsafeCheckpoint otherwise)."""
    unpickler = _MetadataUnpickler(file)
    if source:
        unpickler.source = source
    else:
        name = getattr(file, "name", None)
        unpickler.source = f"{name}" if isinstance(name, str) else unpickler.source
    return unpickler.load()


def restricted_loads(data: bytes):
    return restricted_load(io.BytesIO(data))


class _PickleShim(types.ModuleType):
    """Stands in for the `pickle` module inside torch DCP's filesystem reader: loads are restricted, dumps
    (writing our own checkpoints) are pickle's."""

    load = staticmethod(restricted_load)
    loads = staticmethod(restricted_loads)

    def __getattr__(self, name: str):
        return getattr(pickle, name)


_SHIM = _PickleShim("pickle")


def guard_dcp() -> None:
    """Make torch DCP read `.metadata` through the restricted unpickler (idempotent; call before any load)."""
    filesystem.pickle = _SHIM


COMMON = "common.pt"  # megatron's non-tensor state of a dist checkpoint (iteration, scheduler, param groups)


def check_common(ckpt_dir: Path) -> None:
    """Read `<ckpt_dir>/common.pt` weights-only (tensors and plain containers; nothing runs); UnsafeCheckpoint, one
    line, when it holds anything else. No common.pt: nothing to check (a model-only checkpoint)."""
    path = Path(ckpt_dir) / COMMON
    if not path.is_file():
        return
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = [ln.strip().rstrip(".") for ln in str(err).splitlines() if "unsupported" in ln.lower()]
        what = f" ({found[0]})" if found else ""
        raise UnsafeCheckpoint(
            f"{path} is refused by the weights-only loader{what}: it holds objects a checkpoint "
            f"does not (it may be crafted to run code), nothing was run; load only checkpoints you trust"
        ) from None
