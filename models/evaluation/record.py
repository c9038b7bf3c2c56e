"""One evaluation's results as a frozen, typed record: what was measured and under which settings.

The record is serialized in one place, `results.json` in the evaluation's folder: `evaluate_export` writes it
with `EvalRecord.write`, and everything that reads an evaluation (the pipeline's reuse of it, the per-dataset
report, the CLI) reads it with `EvalRecord.read`. Files written by earlier versions load unchanged: each known
key is read when present, and any other key is kept in `extra`, so `to_dict()` gives back the JSON that was read
(tests/unit/flows/test_records.py reads one the previous release wrote).

Growing it (the sampler's function evaluations, tokens per forward, per-sample outputs, ...) is one field with a
default: `from_dict` and `to_dict` follow the fields, and a file without the key reads as the default. It is the
evaluate stage's result: the pipeline keeps it as `PipelineRun.results` (`PipelineRun.source` for an adapted
model's source), and Prefect stores it as JSON (a pydantic dataclass); a stage cached before it was typed stored
its dict, which `EvalRecord.of` reads. MLflow (`difflm.tracking`, a floor below this room) is handed `to_dict()`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic.dataclasses import dataclass

from difflm.errors import UserError

RESULTS = "results.json"  # in an evaluation's folder


class EvalRecordError(UserError, ValueError):
    """A results.json that cannot be read as an evaluation; the message names the file and what to do."""


@dataclass(frozen=True, kw_only=True)
class EvalRecord:
    """An evaluation of one export on one dataset. The fields are in the order results.json has always listed
    them; a field that is None was not recorded (a file written before it existed) and is left out of
    `to_dict()`."""

    # under which settings
    mode: str  # the export's running mode (its config, not the evaluating one's)
    data_hash: str  # the held-out data it was scored on
    export: str  # the export folder scored
    device: str | None = None  # where it ran: "cpu", "cuda:0"
    dtype: str | None = None  # "float32", "bfloat16": bf16 and fp32 scores differ by the model's arithmetic
    device_name: str | None = None  # the GPU's name, or "cpu"
    # what was measured
    bounds: dict[str, dict[str, Any]]  # "trained" (and "untrained"): likelihood.EvalResult.to_dict()
    tasks: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # task name -> its scores
    task_settings: dict[str, Any] | None = None  # items, mc_samples, seed
    sampler: dict[str, Any] | None = None  # the sampler settings the samples were drawn with
    samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # prompt, completion, tokens, ...
    # not in results.json: what the evaluation did besides
    report: str | None = None  # the per-dataset comparison report it updated (models/evaluation/report.py)
    sweep: list[dict[str, Any]] | None = None  # the sampler sweep's rows (the evaluate flow, `difflm eval`)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # keys this version does not name

    @property
    def trained(self) -> dict[str, Any]:
        """The trained model's bound (every evaluation has one)."""
        return self.bounds["trained"]

    def replace(self, **changes: Any) -> EvalRecord:
        return dataclasses.replace(self, **changes)

    # --- the one serialization -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalRecord:
        """The record of a results.json's content (or of the dict an evaluation returned before it was typed)."""
        named = [f.name for f in dataclasses.fields(cls) if f.name != "extra"]
        missing = [k for k in ("mode", "data_hash", "export", "bounds") if k not in d]
        if missing:
            raise EvalRecordError(f"evaluation results without {', '.join(missing)}: evaluate the export again")
        return cls(
            **{k: d[k] for k in named if k in d and d[k] is not None},
            extra={k: v for k, v in d.items() if k not in named},
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON of results.json: every recorded field, then the keys kept in `extra`."""
        named = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**{k: v for k, v in named.items() if v is not None}, **self.extra}

    @classmethod
    def read(cls, path: str | Path) -> EvalRecord:
        """An evaluation's results.json (`path`, or the folder holding it), written by this version or an earlier one."""
        path = Path(path)
        path = path / RESULTS if path.is_dir() else path
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise EvalRecordError(f"no evaluation results at {path}: evaluate the export first (difflm eval)") from None
        except (json.JSONDecodeError, ValidationError, EvalRecordError) as err:
            raise EvalRecordError(f"{path} is not an evaluation's results ({err}): evaluate the export again") from None

    def write(self, folder: str | Path) -> Path:
        """`<folder>/results.json`, whole or not at all: the comparison report of every run on this data reads
        every results.json, also while another run's evaluation writes its own (no lock: two evaluations of one
        export write the same results)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / f".{RESULTS}.{os.getpid()}-{threading.get_ident()}.part"  # this writer's own
        part.write_text(json.dumps(self.to_dict(), indent=2))
        os.replace(part, folder / RESULTS)
        return folder / RESULTS

    @classmethod
    def of(cls, value: EvalRecord | dict[str, Any]) -> EvalRecord:
        """The evaluate stage's result as Prefect stored it: the record, or (a stage cached before it was typed)
        its dict."""
        return value if isinstance(value, EvalRecord) else cls.from_dict(value)
