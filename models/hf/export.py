"""An HF export folder as one frozen, typed record: what it was written from, in which layout, and how close it
was to the model it came from.

The record is serialized in one place, the folder's marker `difflm_export.json` (difflm.rundir.EXPORT_MARKER):
every writer (`difflm.models.hf.convert.save_export`, hence `export_hf` and `export_stock`) writes it with
`Export.write`, and `Export.read` reads it back, also a marker written before the record existed (only
`checkpoint`, `data_hash`, `mode`: the format is then told by the folder's files, no parity was recorded).
`difflm.rundir.exported_from` reads the same file's `checkpoint` key (floor 1 cannot import this room).

It is the convert stage's result: the pipeline keeps it as `PipelineRun.export`, and Prefect stores it as JSON (a
pydantic dataclass, like `difflm.rundir.TrainResult`); a stage cached before it was typed stored the folder's
path, which `Export.of` reads.
"""

from __future__ import annotations

import json
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, cast, get_args

from pydantic.dataclasses import dataclass

from difflm.errors import UserError
from difflm.rundir import EXPORT_MARKER

# "difflm": this project's model class, its code shipped in the folder (AutoModel with trust_remote_code);
# "hf-stock": a stock transformers class (`difflm.models.hf.importer.export_stock`), no remote code.
# "llada", "dream": LLaDA's or Dream's published layout (`difflm.models.hf.engines.export_engine`), and "gguf":
# that layout's folder with `model.gguf` beside it, which llama.cpp's `llama-diffusion-cli` runs.
ExportFormat = Literal["difflm", "hf-stock", "llada", "dream", "gguf"]
FORMATS: tuple[str, ...] = get_args(ExportFormat)
MODEL_CODE = "modeling_difflm.py"  # shipped only by a "difflm" export: how a marker without a format is told
_FIELDS = ("checkpoint", "format", "mode", "data_hash", "parity")  # the marker's keys the record names


class ExportError(UserError, ValueError):
    """A folder that is not an export difflm wrote, or a marker that cannot be read; the message says what to do."""


@dataclass(frozen=True)
class Export:
    """An HF export: its `folder`, the megatron `checkpoint` it was written from, its `format`, the running mode
    and data hash of the run it came from (None when the writer did not know them), `parity` (the relative max
    logit difference against the megatron model measured when it was written; None where none was measured: a
    "difflm" export computes the same code as training, so only the stock class is checked), and `extra`: the
    marker's other keys (the architecture of a stock export, an iteration, an adapted source's lineage), kept so
    a marker round-trips."""

    folder: Path
    checkpoint: str | None  # None: written from a model in memory (a random init), not from a checkpoint
    format: ExportFormat = "difflm"
    mode: str | None = None
    data_hash: str | None = None
    parity: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def marker(self) -> Path:
        return self.folder / EXPORT_MARKER

    def is_of(self, checkpoint: str | Path) -> bool:
        """Whether it was exported from `checkpoint` (and not from an older one)."""
        return self.checkpoint is not None and self.checkpoint == str(checkpoint)

    # --- the one serialization -------------------------------------------------------------------------------

    def to_marker(self) -> dict[str, Any]:
        """The marker's JSON: the record's fields (None ones left out, as the writers before it did; `checkpoint`
        always, as `difflm.rundir.exported_from` reads it), then `extra`.
        The folder is where the marker lies, not part of it: a moved export stays valid."""
        named = {k: getattr(self, k) for k in _FIELDS if k == "checkpoint" or getattr(self, k) is not None}
        return {**named, **self.extra}

    def write(self, into: Path | None = None) -> Path:
        """Write the marker into `into` (default: the folder; a writer that stages the folder elsewhere passes the
        staging folder, which then becomes `folder`). Returns the marker's path."""
        path = Path(into or self.folder) / EXPORT_MARKER
        path.write_text(json.dumps(self.to_marker(), indent=2))
        return path

    @classmethod
    def from_marker(cls, folder: str | Path, marker: dict[str, Any]) -> Export:
        """The record of `folder` from its marker's JSON, old or new."""
        folder = Path(folder)
        if not isinstance(marker, dict):
            raise ExportError(f"{folder / EXPORT_MARKER} is not an export's marker: export the checkpoint again")
        fmt = marker.get("format") or ("difflm" if (folder / MODEL_CODE).exists() else "hf-stock")
        if fmt not in FORMATS:
            raise ExportError(
                f"{folder} is an export in the {fmt!r} layout, which this version does not know (it reads "
                f"{', '.join(FORMATS)}): use the version that wrote it, or export the checkpoint again"
            )
        parity = marker.get("parity")
        return cls(
            folder=folder,
            checkpoint=None if marker.get("checkpoint") is None else str(marker["checkpoint"]),
            format=cast(ExportFormat, fmt),  # one of FORMATS: checked above
            mode=marker.get("mode"),
            data_hash=marker.get("data_hash"),
            parity=None if parity is None else float(parity),
            extra={k: v for k, v in marker.items() if k not in _FIELDS},
        )

    @classmethod
    def read(cls, folder: str | Path) -> Export:
        """The export in `folder` (its marker), written by this version or an earlier one."""
        folder = Path(folder)
        path = folder / EXPORT_MARKER
        try:
            marker = json.loads(path.read_text())
        except FileNotFoundError:
            raise ExportError(
                f"{folder} is not an HF export written by difflm (no {EXPORT_MARKER}): pass an export folder, "
                f"or export a checkpoint into it (difflm convert)"
            ) from None
        except json.JSONDecodeError as err:
            raise ExportError(f"{path} is not JSON ({err}): export the checkpoint again") from None
        return cls.from_marker(folder, marker)

    @classmethod
    def find(cls, folder: str | Path) -> Export | None:
        """The export in `folder`, or None when it holds none."""
        return cls.read(folder) if (Path(folder) / EXPORT_MARKER).is_file() else None

    @classmethod
    def of(cls, value: Export | str | Path) -> Export:
        """The convert stage's result as Prefect stored it: the record, or (a stage cached before it was typed)
        the export folder's path, read from its marker."""
        return value if isinstance(value, Export) else cls.read(value)
