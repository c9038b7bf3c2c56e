"""What a study will cost before it runs, and which of its points would fail (`difflm study SPEC --plan`): per point
the unique tokens it trains on, its parameters, steps, tokens and training FLOPs (the trainer's own count:
models/megatron/flops.py, the objective's rows and attention included), and the device-hours they take at a given
peak and MFU. Evaluation is left out: a few minutes a point.

A budget is cut in whole documents (data_prep/budget.py), so a point trains on more tokens than its budget: a
document's worth at most, which on a small budget of long documents is a lot (the demo's 20,000 tokens are 31,090
in whole Wikipedia articles: 16 steps an epoch, not 10). The plan counts them as the run will: from the prepared
data, which it prepares first when it is not there yet (the study reuses it), and checks every point's config with
the counts as the run checks it (the budget against the split, the warm-up against the steps). Only where the data
cannot be read here (a corpus on the cluster) does it fall back to the nominal budgets, and says so."""

from __future__ import annotations

from dataclasses import dataclass, field

from difflm.config import ConfigError, Point
from difflm.config.train import iters_for_epochs
from difflm.data_prep.pipeline import MANIFEST, budget_tokens, data_dir, preflight, prepare_data
from difflm.errors import UserError
from difflm.manifest import DataManifest
from difflm.memory import parameter_count
from difflm.models.diffusion.modes import build_objective
from difflm.models.megatron.flops import peak_flops, training_flops

PLAN_COLUMNS = ["point", "unique tokens", "params", "steps", "tokens", "training FLOPs", "device-hours"]


@dataclass
class Counts:
    """The unique tokens each point trains on (by label), and what the run would refuse (label -> its line).
    `exact` is False when the data could not be read and the counts are the nominal budgets (`why`)."""

    tokens: dict[str, int]
    refused: dict[str, str] = field(default_factory=dict)
    exact: bool = True
    why: str = ""
    data: str = ""


def count_tokens(points: list[Point], prepare: bool = True) -> Counts:
    """Each point's unique training tokens as its run will have them (`budget_tokens`: whole documents of the
    prepared split, the whole split without a budget), and the points whose run would refuse its config then
    (`PipelineConfig.with_unique_tokens`, `budget_data`'s check: the same code). The whole split is prepared first
    when `prepare` and it is missing (every point of a study shares it: `_same_heldout`); where its sources cannot
    be read here, the counts are the nominal budgets and only what they settle is refused."""
    whole = points[0].cfg.without_budget()
    manifest_path = data_dir(whole) / MANIFEST
    if not manifest_path.exists():
        try:
            preflight(whole)
        except UserError as err:
            return _nominal(points, " ".join(str(err).split()))
        if not prepare:
            return _nominal(points, f"the data is not prepared yet ({data_dir(whole)})")
        print(
            f"plan: preparing the data to count each budget's whole documents (the study reuses it): {data_dir(whole)}",
            flush=True,
        )
        full = prepare_data(whole)
    else:
        full = DataManifest.read(manifest_path)
    counts = Counts({}, data=full.dir)
    orders: dict = {}
    for point in points:
        try:
            counts.tokens[point.label] = n = budget_tokens(point.cfg, full, orders)
            point.cfg.with_unique_tokens(n)
        except (ConfigError, UserError) as err:
            counts.refused[point.label] = " ".join(str(err).split())
    return counts


def _nominal(points: list[Point], why: str) -> Counts:
    """The budgets themselves: a point whose budget is too short for its warm-up is refused only if it would be
    whatever its documents add, which the plan cannot know, so it is flagged instead (`refused` stays empty)."""
    return Counts({p.label: p.unique_tokens for p in points}, exact=False, why=why)


def short_of_warmup(points: list[Point], counts: Counts) -> list[str]:
    """With nominal counts: the points whose nominal steps are within their warm-up (the run refuses them unless
    their whole documents add the steps they lack)."""
    out: list[str] = []
    if counts.exact:
        return out
    for point in points:
        t = point.cfg.train
        if t.epochs is not None and planned_steps(point, point.unique_tokens) <= t.schedule.warmup_iters:
            out.append(point.label)
    return out


def plan(points: list[Point], device: str, mfu: float, counts: Counts | None = None) -> list[dict]:
    """A row per point: its unique tokens, parameters, steps, tokens seen, training FLOPs and the device-hours of
    one `device` (a name of models/megatron/flops.py's table, e.g. H200) at `mfu`. The steps are over `counts`'
    tokens (the nominal budgets without)."""
    peak = device_peak(device)
    rows = []
    for point in points:
        # a point refused for its budget has no count: its nominal one (the refusal is the plan's last line)
        unique = counts.tokens.get(point.label, point.unique_tokens) if counts else point.unique_tokens
        t, steps = point.cfg.train, planned_steps(point, unique)
        flops = point_flops(point, unique)
        rows.append(
            {
                "point": point.label,
                "unique tokens": unique,
                "params": parameter_count(point.cfg),
                "steps": steps,
                "tokens": steps * t.global_batch_size * t.seq_length,
                "training FLOPs": flops,
                "device-hours": flops / (peak * mfu) / 3600,
            }
        )
    return rows


def device_peak(device: str) -> float:
    """The peak FLOP/s of `device` (UserError: one line naming the devices known)."""
    peak = peak_flops(device)
    if peak is None:
        raise UserError(f"no peak FLOP/s known for device {device!r}: name one of H100, H200, A100, B200, L40S")
    return peak


def planned_steps(point: Point, unique_tokens: int | None = None) -> int:
    """The steps of `point`'s epochs over `unique_tokens` (default: its nominal budget): the run's rule
    (`iters_for_epochs`), or its train_iters when its length is given in steps."""
    t = point.cfg.train
    if t.epochs is None:
        return t.train_iters
    unique = point.unique_tokens if unique_tokens is None else unique_tokens
    return iters_for_epochs(t.epochs, unique, t.global_batch_size, t.seq_length)


def point_flops(point: Point, unique_tokens: int | None = None) -> float:
    """The training FLOPs of a point (its steps times the trainer's count of one step)."""
    cfg, t = point.cfg, point.cfg.train
    step = training_flops(
        cfg, cfg.tokenizer.vocab_size, [t.seq_length] * t.global_batch_size, 1, objective=build_objective(cfg.diffusion)
    )
    return planned_steps(point, unique_tokens) * step


def plan_table(rows: list[dict], device: str, mfu: float, counts: Counts | None = None) -> str:
    """The plan as markdown, ending with the totals and where the unique tokens come from."""

    def cells(r: dict) -> list[str]:
        return (
            [r["point"], f"{r['unique tokens']:,}", f"{r['params'] / 1e6:.1f}M", f"{r['steps']:,}"]
            + [f"{r['tokens']:,}"]
            + [f"{r[c]:.3g}" for c in PLAN_COLUMNS[5:]]
        )

    lines = ["| " + " | ".join(PLAN_COLUMNS) + " |", "|" + "---|" * len(PLAN_COLUMNS)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    hours = sum(r["device-hours"] for r in rows)
    lines += [
        "",
        f"{len(rows)} points, {sum(r['tokens'] for r in rows):,} tokens, "
        f"{sum(r['training FLOPs'] for r in rows):.3g} FLOPs of training: {_amount(hours)} {device}-hours at MFU "
        f"{mfu:g} ({_amount(hours / 24 / 8)} days on 8 of them); evaluation not counted",
    ]
    if counts is not None and counts.exact:
        lines.append(f"unique tokens: each budget in whole documents of the prepared data ({counts.data})")
    elif counts is not None:
        lines.append(
            f"unique tokens: the nominal budgets (the data cannot be counted here: {counts.why}); a budget cut in "
            "whole documents trains on up to a document more, and its points on more steps"
        )
    return "\n".join(lines)


def _amount(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"
