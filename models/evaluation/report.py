"""One report per dataset: every evaluated run on the same data (ar and diffusion alike), on the same items."""

from __future__ import annotations

from pathlib import Path

from difflm.models.evaluation.record import EvalRecord
from difflm.rundir import Workdir

COLUMNS = [  # (header, path into the record: a field, then keys, format)
    ("bound nats/token", ("bounds", "trained", "nll_per_token"), "{:.3f}"),
    ("cloze acc", ("tasks", "cloze", "acc"), "{:.3f}"),
    ("cloze NLL", ("tasks", "cloze", "nll"), "{:.2f}"),
    ("choice acc", ("tasks", "choice", "acc"), "{:.3f}"),
    ("choice acc_norm", ("tasks", "choice", "acc_norm"), "{:.3f}"),
    ("docs bits/byte", ("tasks", "documents", "bits_per_byte"), "{:.3f}"),
]


def _get(record: EvalRecord, path: tuple[str, ...]):
    d = getattr(record, path[0])
    for key in path[1:]:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def comparison_table(results: dict[str, EvalRecord]) -> str:
    """Markdown table: one row per run (name -> its evaluation), with the device and dtype that produced its
    scores (bf16 and fp32 scores of one model differ by its arithmetic)."""
    head = "| run | mode | " + " | ".join(c[0] for c in COLUMNS) + " | items / MC samples | device / dtype |"
    rows = [head, "|" + "---|" * (len(COLUMNS) + 4)]
    for name, res in sorted(results.items()):
        cells = [("-" if (v := _get(res, path)) is None else fmt.format(v)) for _, path, fmt in COLUMNS]
        ts = res.task_settings or {}
        rows.append(
            f"| {name} | {res.mode} | "
            + " | ".join(cells)
            + f" | {ts.get('items', '-')} / {ts.get('mc_samples', '-')} | {placement_label(res.device, res.dtype, res.device_name)} |"
        )
    return "\n".join(rows)


def placement_label(device: str | None, dtype: str | None, device_name: str | None = None) -> str:
    """'cuda:0 (NVIDIA H100) / bfloat16', 'cpu / float32' (an evaluation's `device`, `dtype`, `device_name`, or
    `stages.placement(model)`); '-' for results written before this was recorded."""
    if device is None:
        return "-"
    dev = device if not device_name or device_name == "cpu" else f"{device} ({device_name})"
    return f"{dev} / {dtype or '?'}"


def write_comparison(workdir: Path, data_hash: str) -> Path:
    """<workdir>/reports/data-<hash>.md from every <workdir>/runs/*/eval/results.json on that data."""
    found = {}
    for path in sorted(Workdir(workdir).runs.glob("*/eval/results.json")):
        res = EvalRecord.read(path)
        if res.data_hash == data_hash:
            found[path.parent.parent.name] = res
    out = Workdir(workdir).reports / f"data-{data_hash}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    note = (
        "Bounds: upper bounds on nats/token for diffusion modes (ELBO), exact for ar. Task NLLs are "
        "conditional (MC ELBO for diffusion, exact for ar); every run is scored on the same items."
    )
    out.write_text(f"# Runs on data {data_hash}\n\n{comparison_table(found)}\n\n{note}\n")
    return out
