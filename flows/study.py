"""The `study` flow: a data-constrained study (difflm/config/study.py) as sub-runs of the flagship pipeline.

Every point of the grid is one `difflm.flows.pretrain.pretrain` execution, nested in MLflow under the study's parent run,
each stage cached as in any pipeline run (a point already done is reused: rerunning a study redoes nothing). Every
point is scored on its preset's held-out split, which data.unique_tokens leaves untouched. Points run in threads,
`parallel` at a time: the trainers are processes and train at once, while the stages that compute in this process
(data prep, conversion, evaluation: one torch process group, the same cores) take turns. MLflow keeps one active
run per thread, so each point's run names the study's as its parent. The results table (CSV, markdown), the
plot, the crossover per budget and the data-reuse half-life per family go into the study's folder and the parent
run."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prefect import Task, flow, get_run_logger

from difflm import tracking
from difflm.config import Point, StudySpec, study_spec
from difflm.errors import UserError
from difflm.flows.pretrain import PRETRAIN_STAGES, TRAIN, pretrain
from difflm.flows.stages import Stage
from difflm.models.launch import torchrun
from difflm.tasks import study as results
from difflm.tasks.study_plan import point_flops
from difflm.tracking.plots import plot_study


class StudyFailed(UserError):
    """Some points failed; the table names them and rerunning the study resumes (finished points are reused)."""

    exit_code = 75  # EX_TEMPFAIL: rerunning resumes


@flow(name="study", log_prints=True)
def study(spec: str, preset: str | None = None, overrides: list[str] | None = None) -> dict:
    """Run a data-constrained study: every point of its grid a cached sub-run of pretrain-difflm.

    Args:
        spec: a study YAML file (families x unique_tokens x epochs x sizes; docs/study.md).
        preset: replaces the spec's preset (a name in configs/ or a YAML path).
        overrides: `section.field=value` overrides added to the spec's `base` (every point).
    """
    return run_study(study_spec(spec, preset, overrides), get_run_logger().info)


def run_study(spec: StudySpec, say) -> dict:
    """The flow's body, as a plain function: `say` prints one progress line per point."""
    points = spec.points()  # every point's config checked before anything runs
    for point in points:  # and the server each tracks to: one the credentials are not for is refused now
        if point.cfg.tracking.enabled:
            tracking.tracking_uri(point.cfg)
    out_dir = spec.output_dir(points[0].cfg)
    say(f"study {spec.name}: {len(points)} points, {spec.parallel} at a time; results in {out_dir}")
    torchrun.STOP.clear()
    # each point reports its own tracking failures (its pretrain's summary); the study's are the parent run's
    with (
        tracking.degradations() as degraded,
        tracking.study_run(points[0].cfg, spec.name, spec.model_dump(mode="json")) as parent,
    ):
        pool = ThreadPoolExecutor(max_workers=spec.parallel, thread_name_prefix="study-point")
        try:
            # each point in a copy of this context: its Prefect tasks belong to this flow run
            futures = {
                k: pool.submit(contextvars.copy_context().run, _run_point, spec, points[k], i, len(points), parent, say)
                for i, k in enumerate(start_order(points, spec.parallel), 1)
            }
            rows = [futures[k].result() for k in range(len(points))]  # the table in the grid's order
        except BaseException:  # Ctrl-C or SIGTERM: no point starts, the training ones checkpoint and stop
            torchrun.STOP.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown()
        summary = _report(spec, rows, out_dir, parent)
    summary["tracking"] = tracking.summary_line(degraded)
    say(f"study {spec.name}: {summary['crossover_line']}; table {summary['table_md']}")
    for label, half_life in summary["half_life"].items():
        say(f"study {spec.name}: {label}: {half_life}")
    failed = [r for r in rows if r["status"].startswith("failed")]
    if failed:
        raise StudyFailed(
            f"study {spec.name}: {len(failed)} of {len(rows)} points failed (see {summary['table_md']}); rerun it to "
            "retry them (finished points are reused)"
        )
    return summary


def start_order(points: list[Point], parallel: int) -> list[int]:
    """The order points start in: the grid's with one at a time; with several, the longest first (by training
    FLOPs), so that the study does not end on one long point training alone while the other slots idle."""
    if parallel == 1:
        return list(range(len(points)))
    cost = [point_flops(p) for p in points]
    return sorted(range(len(points)), key=lambda k: -cost[k])


def _run_point(spec: StudySpec, point: Point, i: int, n: int, parent: str | None, say) -> dict:
    """One point as a nested pipeline run; its row (a failure is a row too: the other points go on)."""
    start = time.monotonic()
    say(f"[{i}/{n}] {point.label}: started")
    tags = {
        "study": spec.name,
        "study.family": point.family,
        "study.unique_tokens": str(point.unique_tokens),
        "study.epochs": f"{point.epochs:g}",
        "study.size": point.size or "preset",
    }
    try:
        name = f"{spec.name}/{point.label}"
        summary = pretrain(point.cfg, _Quiet(), parent=parent, run_name=name, tags=tags, rows=_rows())
    except Exception as err:  # the study reports it in its table and goes on
        say(f"[{i}/{n}] {point.label}: FAILED after {time.monotonic() - start:.0f} s: {type(err).__name__}: {err}")
        return results.failed_row(point, err)
    row = results.row(point, summary)
    say(
        f"[{i}/{n}] {point.label}: {row['status']} in {time.monotonic() - start:.0f} s: validation "
        f"{row['validation_nll']:.4f} nats/token ({row['bound']}), {row['steps']} steps, {row['tokens_seen']:,} tokens"
    )
    return row


_IN_PROCESS = threading.Lock()  # one point at a time runs a stage that computes in this process


def _rows() -> list[Stage]:
    """The pipeline's rows, each but training (its own processes) taking its turn in this process."""
    return [row if row is TRAIN else _taking_turns(row) for row in PRETRAIN_STAGES]


def _taking_turns(row: Stage) -> Stage:
    fn = row.task.fn if isinstance(row.task, Task) else row.task

    @functools.wraps(fn)
    def turn(*args, **kwargs):
        with _IN_PROCESS:
            return fn(*args, **kwargs)

    return dataclasses.replace(row, task=turn)


class _Quiet:
    """The pipeline's logger for a point: its progress line is the study's; the rest goes to Prefect's log."""

    def info(self, msg: str) -> None:
        try:
            get_run_logger().debug(msg)
        except Exception:  # outside a flow run (a plain call): nothing to log to
            pass


def _report(spec: StudySpec, rows: list[dict], out_dir: Path, parent: str | None) -> dict:
    csv_path, md_path = results.write_table(rows, out_dir)
    curves = results.write_curves(rows, out_dir)
    crossings = results.crossover(rows)
    line = results.crossover_line(crossings)
    fits = results.half_lives(rows)
    plot = plot_study(rows, out_dir / "study.png", f"study {spec.name}: crossover {line}")
    files = [p for p in (csv_path, md_path, curves, plot) if p]
    if parent:
        tracking.log_files(files, "study")
        half_life = {f"study.half_life.{fit.label}": fit.tag()[:5000] for fit in fits}
        tracking.set_tags({"study.crossover": line[:5000], **half_life})
    return {
        "name": spec.name,
        "out_dir": str(out_dir),
        "table_csv": str(csv_path),
        "table_md": str(md_path),
        "curves_csv": str(curves),
        "plot": str(plot) if plot else None,
        "crossover": {str(k): v for k, v in crossings.items()},
        "crossover_line": line,
        "half_life": {fit.label: fit.line() for fit in fits},
        "rows": rows,
        "mlflow_run_id": parent,
    }
