"""What a study will cost before it runs (`difflm study SPEC --plan`): per point its parameters, steps, tokens and
training FLOPs (the trainer's own count: models/megatron/flops.py, the objective's rows and attention included),
and the device-hours they take at a given peak and MFU. Evaluation is left out: a few minutes a point.

The steps are those of the budget itself; a budget is cut in whole documents, so a point trains on a few more
tokens than its budget (a document's worth at most), and its steps grow in proportion."""

from __future__ import annotations

from difflm.config import Point
from difflm.config.train import iters_for_epochs
from difflm.memory import parameter_count
from difflm.models.diffusion.modes import build_objective
from difflm.models.megatron.flops import peak_flops, training_flops

PLAN_COLUMNS = ["point", "params", "steps", "tokens", "training FLOPs", "device-hours"]


def plan(points: list[Point], device: str, mfu: float) -> list[dict]:
    """A row per point: its parameters, steps, tokens seen, training FLOPs and the device-hours of one `device`
    (a name of models/megatron/flops.py's table, e.g. H200) at `mfu`."""
    peak = peak_flops(device)
    if peak is None:
        raise ValueError(f"no peak FLOP/s known for device {device!r}: name one of H100, H200, A100, B200, L40S")
    rows = []
    for point in points:
        t, steps = point.cfg.train, planned_steps(point)
        flops = point_flops(point)
        rows.append(
            {
                "point": point.label,
                "params": parameter_count(point.cfg),
                "steps": steps,
                "tokens": steps * t.global_batch_size * t.seq_length,
                "training FLOPs": flops,
                "device-hours": flops / (peak * mfu) / 3600,
            }
        )
    return rows


def planned_steps(point: Point) -> int:
    """The steps of `point`'s epochs over its budget. Not checked against the warmup as the run checks them: the
    whole documents of its subset may add the steps a short point lacks, and a plan only estimates."""
    t = point.cfg.train
    return iters_for_epochs(point.epochs, point.unique_tokens, t.global_batch_size, t.seq_length)


def point_flops(point: Point) -> float:
    """The training FLOPs of a point over its budget (its steps times the trainer's count of one step)."""
    cfg, t = point.cfg, point.cfg.train
    step = training_flops(
        cfg, cfg.tokenizer.vocab_size, [t.seq_length] * t.global_batch_size, 1, objective=build_objective(cfg.diffusion)
    )
    return planned_steps(point) * step


def plan_table(rows: list[dict], device: str, mfu: float) -> str:
    """The plan as markdown, ending with the totals."""

    def cells(r: dict) -> list[str]:
        return [r["point"], f"{r['params'] / 1e6:.1f}M", f"{r['steps']:,}", f"{r['tokens']:,}"] + [
            f"{r[c]:.3g}" for c in PLAN_COLUMNS[4:]
        ]

    lines = ["| " + " | ".join(PLAN_COLUMNS) + " |", "|" + "---|" * len(PLAN_COLUMNS)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    hours = sum(r["device-hours"] for r in rows)
    lines += [
        "",
        f"{len(rows)} points, {sum(r['tokens'] for r in rows):,} tokens, "
        f"{sum(r['training FLOPs'] for r in rows):.3g} FLOPs of training: {_amount(hours)} {device}-hours at MFU "
        f"{mfu:g} ({_amount(hours / 24 / 8)} days on 8 of them); evaluation not counted",
    ]
    return "\n".join(lines)


def _amount(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"
