"""One report per dataset: every evaluated run on the same data (ar and diffusion alike), on the same items."""

from __future__ import annotations

from pathlib import Path

from difflm.models.evaluation.record import COLUMNS, TABLE_HEAD, EvalRecord, placement_label, record_row  # noqa: F401
from difflm.rundir import Workdir


def comparison_table(results: dict[str, EvalRecord]) -> str:
    """Markdown table: one row per run (name -> its evaluation), with the device and dtype that produced its
    scores (bf16 and fp32 scores of one model differ by its arithmetic)."""
    rows = [TABLE_HEAD, "|" + "---|" * (len(COLUMNS) + 4)]
    rows += [record_row(name, res) for name, res in sorted(results.items())]
    return "\n".join(rows)


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
