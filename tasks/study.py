"""The study's results, as plain functions: one row per point from its pipeline summary, the table (CSV and
markdown), and the crossover per budget (the smallest epochs at which the best diffusion family beats the best
AR family, or none), and the data-reuse half-life R* per family fitted where there are enough points."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from difflm.config import Point
from difflm.models.diffusion.modes import objective_class
from difflm.rundir import RunDir

CURVE_COLUMNS = ["family", "kind", "unique_tokens", "epochs", "size", "step", "epochs_seen", "val_loss"]
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
    return "diffusion" if objective_class(point.cfg.diffusion.model_running_mode).bidirectional else "ar"


def _point_columns(point: Point) -> dict:
    """The columns that say which point a row is (a finished or a failed one)."""
    return {
        "family": point.family,
        "kind": kind_of(point),
        "unique_tokens": point.unique_tokens,
        "epochs": point.epochs,
        "size": point.size or "preset",
    }


def row(point: Point, summary: dict) -> dict:
    """The point's table row from its pipeline summary (difflm.flows.pretrain.run_pipeline): the trained model's
    validation NLL per token on the held-out split (exact for ar, an upper bound for diffusion)."""
    trained = summary["validation"]["trained"]
    t = point.cfg.train
    ran = [k for k, v in summary["stages"].items() if v == "ran"]
    return {
        **_point_columns(point),
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
        "curve": training_curve(point, summary["run_dir"], summary["unique_tokens"]),
    }


def training_curve(point: Point, run_dir: str, subset_tokens: int) -> list[tuple[int, float, float]]:
    """(step, epochs seen, validation loss) at each validation while the point trained (every
    train.eval_interval steps: metrics.jsonl's val_loss, on the validation split's fixed batches), after the
    first step. Its last value is the table's within the noise of other batches and timesteps."""
    t = point.cfg.train
    per_step = t.global_batch_size * t.seq_length
    return [
        (int(r["step"]), round(r["step"] * per_step / subset_tokens, 4), float(r["val_loss"]))
        for r in RunDir(run_dir).metrics()
        if r.get("val_loss") is not None and r["step"] > 0
    ]


def failed_row(point: Point, err: BaseException) -> dict:
    return {
        **{k: "" for k in COLUMNS},
        **_point_columns(point),
        "curve": [],
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
    """results.csv and results.md in `out_dir` (the markdown ends with the crossover per budget and the
    data-reuse half-life per family)."""
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
        *(f"{fit.label}: {fit.line()}" for fit in half_lives(rows)),
        "",
    ]
    md_path.write_text("\n".join(lines))
    return csv_path, md_path


def write_curves(rows: list[dict], out_dir: Path) -> Path:
    """curves.csv in `out_dir`: every point's validation while it trained, a line per evaluation."""
    path = out_dir / "curves.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CURVE_COLUMNS)
        for r in rows:
            for step, epochs_seen, val in r.get("curve", []):
                writer.writerow([*(r[c] for c in CURVE_COLUMNS[:5]), step, epochs_seen, val])
    return path


# The data-reuse half-life (Muennighoff et al., "Scaling Data-Constrained Language Models"; Prabhudesai et al.
# fit R* ~ 500 for masked diffusion, ~ 15 for AR): U unique tokens seen for R = epochs - 1 extra epochs are worth
# D' = U + U R* (1 - exp(-R / R*)) fresh tokens, and the loss is L = E_inf + A / D'^ALPHA. R* is the constant the
# papers call the half-life: after R* repetitions a further epoch is worth 1/e of fresh data (half: R* ln 2).
# ALPHA is fixed: a study has a handful of epochs per family, too few to tell ALPHA from R* (they trade off). 0.3 is
# near the data exponent fitted on fresh data (Chinchilla: 0.28); a wrong one biases R* (docs/study.md has figures)
ALPHA = 0.3
MIN_EPOCHS = 3  # distinct epochs above 1: R*, E_inf and A are three unknowns
R_STAR_GRID = np.logspace(-1, 4, 501)  # 0.1 to 10,000 repetitions, log-spaced
# The interval's noise: the residuals' own variance, but never below NOISE_FLOOR (nats/token), the spread of a small
# model's held-out NLL between runs (docs/study.md: 0.02 nats up to 20 epochs), so that a few points that happen to
# lie on a curve do not pin R* down more than a rerun would
NOISE_FLOOR = 0.01
# t quantiles at 0.975 by degrees of freedom: F(1, d) at 0.95 is their square; past 30 the normal's 1.96
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
_T975 |= {11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}


def _f95(dof: int) -> float:
    """F(1, dof)'s 95% quantile (dof 0: the noise is the floor alone, known: the chi-squared's 3.84)."""
    if dof <= 0 or dof > 30:
        return 1.96**2
    return _T975[max(d for d in _T975 if d <= dof)] ** 2


@dataclass(frozen=True)
class HalfLife:
    """A family's R*: the best fit and its 95% profile interval [low, high] (None: unbounded on that side, the
    points fit any R* past the grid's end); absent (`reason` says why) where there is nothing to fit."""

    label: str
    points: int
    r_star: float | None = None
    low: float | None = None
    high: float | None = None
    reason: str = ""

    @property
    def identified(self) -> bool:
        return self.r_star is not None and (self.low is not None or self.high is not None)

    def line(self) -> str:
        n = f"fit on {self.points} points"
        if self.r_star is None:
            return f"data-reuse half-life: absent ({self.reason})"
        if self.low is not None and self.high is not None:
            return (
                f"data-reuse half-life: R* = {self.r_star:.3g} epochs (95% interval {self.low:.3g} to "
                f"{self.high:.3g}; {n})"
            )
        if self.low is not None:
            return (
                f"data-reuse half-life: R* above {self.low:.3g} epochs (95% interval; no upper bound: the points "
                f"fit any larger R*; {n})"
            )
        if self.high is not None:
            return (
                f"data-reuse half-life: R* below {self.high:.3g} epochs (95% interval; no lower bound: the points "
                f"fit any smaller R*; {n})"
            )
        return (
            f"data-reuse half-life: not identified by these points (any R* from {R_STAR_GRID[0]:g} to "
            f"{R_STAR_GRID[-1]:,.0f} epochs fits them within the noise; {n})"
        )

    def tag(self) -> str:
        """The value of the parent run's tag `study.half_life.<label>`."""
        if self.r_star is None:
            return f"absent: {self.reason}"
        if self.low is not None and self.high is not None:
            return f"{self.r_star:.4g} [{self.low:.3g}, {self.high:.3g}]"
        if self.low is not None:
            return f">{self.low:.3g}"
        return f"<{self.high:.3g}" if self.high is not None else "not identified"


def effective_tokens(unique: float, epochs: float, r_star: float) -> float:
    """D': the fresh tokens that `epochs` passes over `unique` tokens are worth (R* = inf: all of them)."""
    repeats = max(epochs - 1.0, 0.0)
    if math.isinf(r_star):
        return unique * (1.0 + repeats)
    return unique * (1.0 + r_star * -math.expm1(-repeats / r_star))


def half_lives(rows: list[dict]) -> list[HalfLife]:
    """R* per family (per family and size when the rows have several sizes), from its finished points."""
    done = [r for r in rows if r.get("validation_nll") not in ("", None)]
    groups = sorted({(r["family"], r.get("size", "preset")) for r in rows})
    several_sizes = len({size for _, size in groups}) > 1
    return [
        fit_half_life(
            [r for r in done if (r["family"], r.get("size", "preset")) == (family, size)],
            f"{family}/{size}" if several_sizes else family,
        )
        for family, size in groups
    ]


def fit_half_life(rows: list[dict], label: str) -> HalfLife:
    """Fit R* to one family's points: L = E_inf + A_U / D'(U, E)^ALPHA with E_inf and R* shared and A_U one per
    budget (it absorbs U^ALPHA); R* by a log-spaced grid, E_inf and A_U by least squares at each (an R* that needs
    a negative A_U is no fit). Epochs are those the steps made over the subset (`epochs_seen`) when the row has
    them. A budget with a single number of repeats tells nothing of R* (its A_U fits it exactly): left out.

    The interval is the profile's: every R* of the grid whose residual sum of squares is within F(1, n - p) x the
    noise variance of the best (n points, p = 2 + budgets unknowns; the noise the residuals' variance, at least
    NOISE_FLOOR squared). Where it reaches an end of the grid the points set no bound on that side; where it
    reaches both, they say nothing of R* (a free E_inf absorbs any curve through a few noisy points)."""
    repeats: dict[int, set[float]] = {}
    for r in rows:
        repeats.setdefault(r["unique_tokens"], set()).add(max(_epochs(r) - 1.0, 0.0))
    rows = [r for r in rows if len(repeats[r["unique_tokens"]]) > 1]
    above_one = {_epochs(r) for r in rows if _epochs(r) > 1}
    if len(above_one) < MIN_EPOCHS:
        return HalfLife(label, len(rows), reason=f"needs {MIN_EPOCHS} epochs above 1; has {len(above_one)}")
    loss = np.array([float(r["validation_nll"]) for r in rows])
    budgets = sorted({r["unique_tokens"] for r in rows})
    seen = [(float(r["unique_tokens"]), _epochs(r)) for r in rows]

    def sse(r_star: float) -> float | None:
        """The residual sum of squares at this R* (None: the best A_U is negative, loss rising with data)."""
        x = np.array([effective_tokens(u, e, r_star) ** -ALPHA for u, e in seen])
        design = np.zeros((len(rows), 1 + len(budgets)))
        design[:, 0] = 1.0
        for i, r in enumerate(rows):
            design[i, 1 + budgets.index(r["unique_tokens"])] = x[i]
        coef, *_ = np.linalg.lstsq(design, loss, rcond=None)
        if (coef[1:] < 0).any():
            return None
        return float(((design @ coef - loss) ** 2).sum())

    profile = [(float(r), sse(float(r))) for r in R_STAR_GRID]
    fits = [(s, r) for r, s in profile if s is not None]
    if not fits:
        return HalfLife(label, len(rows), reason="the validation loss does not fall as the data grows")
    least, best = min(fits)
    dof = len(rows) - (2 + len(budgets))
    noise = max(least / dof if dof > 0 else 0.0, NOISE_FLOOR**2)
    inside = [r for r, s in profile if s is not None and s <= least + _f95(dof) * noise]
    low = None if inside[0] == profile[0][0] else inside[0]
    high = None if inside[-1] == profile[-1][0] else inside[-1]
    return HalfLife(label, len(rows), r_star=best, low=low, high=high)


def _epochs(row: dict) -> float:
    seen = row.get("epochs_seen")
    return float(seen) if seen not in ("", None) else float(row["epochs"])
