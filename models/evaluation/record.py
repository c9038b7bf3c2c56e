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
    # the protocol (protocol.py): what a reproduction must match, and the cost of decoding (efficiency.py)
    model: dict[str, Any] | None = None  # weight and tokenizer digests, checkpoint, objective, mask id, block size
    decoding: dict[str, Any] | None = None  # the sampler settings every generation used, fixed before scoring
    efficiency: dict[str, Any] | None = None  # nfe, valid_tokens, tpf, tokens/s (batch 1, batched), TTFT, memory
    aup: dict[str, Any] | None = None  # accuracy under parallelism over the sweep's settings
    baseline: dict[str, Any] | None = None  # the AR model's row: same items, engine and hardware
    environment: dict[str, Any] | None = None  # versions, commit, host, date
    engines: list[dict[str, Any]] | None = None  # a row per engine on this model: engine, version, tokens/s, settings
    # what the evaluation did besides: the sweep is written with the record when one ran, the report never
    sweep: list[dict[str, Any]] | None = None  # the sampler sweep's rows (the evaluate flow, `difflm eval`)
    report: str | None = None  # the per-dataset comparison report it updated (models/evaluation/report.py)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # keys this version does not name

    @property
    def nfe(self) -> int | None:
        return (self.efficiency or {}).get("nfe")

    @property
    def tpf(self) -> float | None:
        return (self.efficiency or {}).get("tpf")

    @property
    def trained(self) -> dict[str, Any]:
        """The trained model's bound (every evaluation has one)."""
        return self.bounds["trained"]

    def tracked(self, name: str | None = None) -> dict[str, Any]:
        """What MLflow is handed (difflm.tracking.log_evaluation, a floor below this room): the JSON and the
        record's row of the comparison table."""
        row = record_row(name or Path(self.export).parent.name or self.export, self)
        return {**self.to_dict(), "table_row": f"{TABLE_HEAD}\n|{'---|' * (len(COLUMNS) + 4)}\n{row}\n"}

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


# ---- the record as a row of a markdown table (the per-dataset report, `difflm compare`, MLflow) ----------

COLUMNS = [  # (header, path into the record: a field, then keys, format)
    ("bound nats/token", ("bounds", "trained", "nll_per_token"), "{:.3f}"),
    ("cloze acc", ("tasks", "cloze", "acc"), "{:.3f}"),
    ("cloze NLL", ("tasks", "cloze", "nll"), "{:.2f}"),
    ("choice acc", ("tasks", "choice", "acc"), "{:.3f}"),
    ("choice acc_norm", ("tasks", "choice", "acc_norm"), "{:.3f}"),
    ("docs bits/byte", ("tasks", "documents", "bits_per_byte"), "{:.3f}"),
    ("gen exact match", ("tasks", "cloze_gen", "exact_match_flexible"), "{:.3f}"),
    ("NFE", ("efficiency", "nfe"), "{:d}"),
    ("TPF", ("efficiency", "tpf"), "{:.2f}"),
    ("tokens/s (batch 1)", ("efficiency", "tokens_per_s_batch1"), "{:.1f}"),
    ("AUP", ("aup", "value"), "{:.1f}"),
]


def _get(record: EvalRecord, path: tuple[str, ...]):
    d = getattr(record, path[0])
    for key in path[1:]:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


TABLE_HEAD = "| run | mode | " + " | ".join(c[0] for c in COLUMNS) + " | items / MC samples | device / dtype |"


def record_row(name: str, res: EvalRecord) -> str:
    """The record as one row of the comparison table (TABLE_HEAD's columns)."""
    cells = [("-" if (v := _get(res, path)) is None else fmt.format(v)) for _, path, fmt in COLUMNS]
    ts = res.task_settings or {}
    return (
        f"| {name} | {res.mode} | "
        + " | ".join(cells)
        + f" | {ts.get('items', '-')} / {ts.get('mc_samples', '-')} | "
        + f"{placement_label(res.device, res.dtype, res.device_name)} |"
    )


def placement_label(device: str | None, dtype: str | None, device_name: str | None = None) -> str:
    """'cuda:0 (NVIDIA H100) / bfloat16', 'cpu / float32' (an evaluation's `device`, `dtype`, `device_name`, or
    `stages.placement(model)`); '-' for results written before this was recorded."""
    if device is None:
        return "-"
    dev = device if not device_name or device_name == "cpu" else f"{device} ({device_name})"
    return f"{dev} / {dtype or '?'}"
