"""The study's results, as plain functions: one row per point from its pipeline summary, the table (CSV and
markdown), and the crossover per budget (the smallest epochs at which the best diffusion family beats the best
AR family, or none)."""

from __future__ import annotations

import csv
from pathlib import Path

from difflm.config import Point

COLUMNS = [
    "family",
    "kind",
    "unique_tokens",
    "epochs",
    "size",
    "validation_nll",
    "bound",
    "steps",
    "tokens_seen",
    "subset_tokens",
    "epochs_seen",
    "status",
    "mlflow_run_id",
]


def kind_of(point: Point) -> str:
    """`ar` for the autoregressive arms (plain, strong, MIR), `diffusion` for every other mode."""
    return "ar" if point.cfg.diffusion.model_running_mode == "ar" else "diffusion"


def row(point: Point, summary: dict) -> dict:
    """The point's table row from its pipeline summary (flows.pretrain.run_pipeline): the trained model's
    validation NLL per token on the held-out split (exact for ar, an upper bound for diffusion)."""
    trained = summary["validation"]["trained"]
    t = point.cfg.train
    ran = [k for k, v in summary["stages"].items() if v == "ran"]
    return {
        "family": point.family,
        "kind": kind_of(point),
        "unique_tokens": point.unique_tokens,
        "epochs": point.epochs,
        "size": point.size or "preset",
        "validation_nll": round(trained["nll_per_token"], 4),
        "bound": trained["kind"],
        "steps": summary["train_iters"],
        "tokens_seen": summary["train_iters"] * t.global_batch_size * t.seq_length,
        # the budget's subset is whole documents: its tokens, and the epochs over them the steps made
        "subset_tokens": summary["unique_tokens"],
        "epochs_seen": summary["planned_epochs"],
        "status": f"ran {', '.join(ran)}" if ran else "reused",
        "mlflow_run_id": summary.get("mlflow_run_id") or "",
        "heldout_tokens": trained["tokens"],
    }


def failed_row(point: Point, err: BaseException) -> dict:
    return {
        **{k: "" for k in COLUMNS},
        "family": point.family,
        "kind": kind_of(point),
        "unique_tokens": point.unique_tokens,
        "epochs": point.epochs,
        "size": point.size or "preset",
        "status": f"failed: {type(err).__name__}: {' '.join(str(err).split())[:200]}",
    }


def crossover(rows: list[dict]) -> dict[int, float | None]:
    """Per budget: the smallest epochs at which the best diffusion family's validation NLL is below the best AR
    family's at the same epochs (None: never, or one kind has no finished point there)."""
    out: dict[int, float | None] = {}
    for budget in sorted({r["unique_tokens"] for r in rows}):
        out[budget] = None
        done = [r for r in rows if r["unique_tokens"] == budget and r["validation_nll"] != ""]
        for epochs in sorted({r["epochs"] for r in done}):
            best = {
                kind: min(
                    (r["validation_nll"] for r in done if r["epochs"] == epochs and r["kind"] == kind), default=None
                )
                for kind in ("diffusion", "ar")
            }
            if best["diffusion"] is not None and best["ar"] is not None and best["diffusion"] < best["ar"]:
                out[budget] = epochs
                break
    return out


def crossover_line(crossings: dict[int, float | None]) -> str:
    return "; ".join(
        f"{budget:,} unique tokens: {'none' if e is None else f'{e:g} epochs'}" for budget, e in crossings.items()
    )


def write_table(rows: list[dict], out_dir: Path) -> tuple[Path, Path]:
    """results.csv and results.md in `out_dir` (the markdown ends with the crossover per budget)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / "results.csv", out_dir / "results.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    lines += [
        "",
        f"crossover (smallest epochs where the best diffusion family beats the best AR family): "
        f"{crossover_line(crossover(rows))}",
        "",
    ]
    md_path.write_text("\n".join(lines))
    return csv_path, md_path
