"""One report per dataset: every evaluated run on the same data (ar and diffusion alike), on the same items."""

from __future__ import annotations

import json
from pathlib import Path

from difflm.rundir import Workdir

COLUMNS = [  # (header, path into results.json, format)
    ("bound nats/token", ("bounds", "trained", "nll_per_token"), "{:.3f}"),
    ("cloze acc", ("tasks", "cloze", "acc"), "{:.3f}"),
    ("cloze NLL", ("tasks", "cloze", "nll"), "{:.2f}"),
    ("choice acc", ("tasks", "choice", "acc"), "{:.3f}"),
    ("choice acc_norm", ("tasks", "choice", "acc_norm"), "{:.3f}"),
    ("docs bits/byte", ("tasks", "documents", "bits_per_byte"), "{:.3f}"),
]


def _get(d: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def comparison_table(results: dict[str, dict]) -> str:
    """Markdown table: one row per run (name -> results.json content), with the device and dtype that
    produced its scores (bf16 and fp32 scores of one model differ by its arithmetic)."""
    head = "| run | mode | " + " | ".join(c[0] for c in COLUMNS) + " | items / MC samples | device / dtype |"
    rows = [head, "|" + "---|" * (len(COLUMNS) + 4)]
    for name, res in sorted(results.items()):
        cells = [("-" if (v := _get(res, path)) is None else fmt.format(v)) for _, path, fmt in COLUMNS]
        ts = res.get("task_settings", {})
        rows.append(
            f"| {name} | {res.get('mode', '?')} | "
            + " | ".join(cells)
            + f" | {ts.get('items', '-')} / {ts.get('mc_samples', '-')} | {placement_label(res)} |"
        )
    return "\n".join(rows)


def placement_label(res: dict) -> str:
    """'cuda:0 (NVIDIA H100) / bfloat16', 'cpu / float32'; '-' for results written before this was recorded."""
    if "device" not in res:
        return "-"
    name = res.get("device_name")
    dev = res["device"] if not name or name == "cpu" else f"{res['device']} ({name})"
    return f"{dev} / {res.get('dtype', '?')}"


def write_comparison(workdir: Path, data_hash: str) -> Path:
    """<workdir>/reports/data-<hash>.md from every <workdir>/runs/*/eval/results.json on that data."""
    found = {}
    for path in sorted(Workdir(workdir).runs.glob("*/eval/results.json")):
        res = json.loads(path.read_text())
        if res.get("data_hash") == data_hash:
            found[path.parent.parent.name] = res
    out = Workdir(workdir).reports / f"data-{data_hash}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    note = (
        "Bounds: upper bounds on nats/token for diffusion modes (ELBO), exact for ar. Task NLLs are "
        "conditional (MC ELBO for diffusion, exact for ar); every run is scored on the same items."
    )
    out.write_text(f"# Runs on data {data_hash}\n\n{comparison_table(found)}\n\n{note}\n")
    return out
