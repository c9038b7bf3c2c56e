"""The pipeline as a table of stages. A `Stage` row says what one stage runs, the folder it writes, when that
folder already holds its finished output, its Prefect cache key, what it tells MLflow and its Prefect summary;
`run_stages` runs rows in order inside the pipeline's MLflow run. `pretrain-difflm` and `adapt-difflm` are lists
of rows (flows/pretrain.py, flows/adapt.py); a new stage is a function and one row.

Every row behaves the same way: a nested MLflow run named after the stage (tags `cached` and the row's own), the
Prefect cache keyed by what names its output (`difflm.tasks.cache.run_stage`: a cache hit only while the output is on
disk), a status `ran` / `cached` / `reused`, and a markdown artifact `<name>-summary` linking the MLflow run. A row
holds its output's lock (`difflm.locks`) from the check of whether it is done to its `after` hook, so two
pipelines on one workdir never write the same folder: the second waits (or fails, `pipeline.on_busy`) and reuses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError

from difflm import tracking
from difflm.config import PipelineConfig
from difflm.locks import exclusive
from difflm.rundir import lock_file
from difflm.tasks import artifacts
from difflm.tasks.cache import cache_key, run_stage


def status(cached: bool, done: bool) -> str:
    """What a stage did: `cached` (Prefect skipped it), `reused` (it found its finished output), or `ran`."""
    return "cached" if cached else "reused" if done else "ran"


def ran_or_cached(cached: bool, done: bool) -> str:
    """The status of a stage whose task never reports a reuse of its own."""
    return "cached" if cached else "ran"


@dataclass
class PipelineRun:
    """What the stages of one execution share: the config (a row may replace it: the import), the pipeline's
    MLflow run and its link, each stage's status, and each stage's result under the row's `slot`."""

    cfg: PipelineConfig
    run_id: str | None
    link: str | None
    stages: dict[str, str]
    results: dict[str, Any] = field(default_factory=dict)
    lineage: dict | None = None  # the HF source's `difflm.tasks.adapt.source_lineage`, when the run imports one
    sid: str | None = None  # the running stage's nested MLflow run (None: tracking off, or between stages)

    def __getitem__(self, slot: str) -> Any:
        return self.results[slot]


@dataclass
class Outcome:
    """One stage's run, as its hooks see it."""

    result: Any
    cached: bool  # Prefect's cache skipped it
    done: bool  # its output was already complete before it ran
    output: Path
    key: str
    sid: str | None  # its nested MLflow run (None: tracking off)


def _always(run: PipelineRun) -> bool:
    return True


def _no_tags(run: PipelineRun, out: Outcome) -> dict:
    return {}


@dataclass(frozen=True)
class Stage:
    """One row of a pipeline."""

    name: str  # the MLflow stage run, the status key, the cache key's prefix, the artifact `<name>-summary`
    task: Task | Callable  # a Prefect task, or a plain function (run as a task named `name`)
    slot: str  # the name its result is kept under (`PipelineRun[slot]`) for later rows
    output: Callable[[PipelineRun], Path]  # the folder it writes: its place in the run directory or the workdir
    done: Callable[[PipelineRun, Path], bool]  # that folder already holds its finished output
    args: Callable[[PipelineRun, Path, str], tuple]  # the task's arguments (given the output and the cache key)
    key: Callable[[PipelineRun, Path], str] | None = None  # the Prefect cache key; default: name + output
    summary: Callable[[PipelineRun, Outcome], str] | None = None  # the markdown of its Prefect artifact
    title: str = ""  # the artifact's description
    tags: Callable[[PipelineRun, Outcome], dict] = _no_tags  # more tags of its MLflow stage run
    read: Callable[[Any], Any] = lambda result: result  # its result as stored by Prefect -> its typed value
    before: Callable[[PipelineRun], None] | None = None  # in its stage run, before the task
    log: Callable[[PipelineRun, Outcome], None] | None = None  # in its stage run (when there is one), after it
    after: Callable[[PipelineRun, Outcome], None] | None = None  # once its stage run closed: the parent run
    when: Callable[[PipelineRun], bool] = _always  # whether this execution runs it at all
    status: Callable[[bool, bool], str] = status
    system_metrics: bool = False  # MLflow samples the machine while it runs (unless its output is done)

    def as_task(self) -> Task:
        return self.task if isinstance(self.task, Task) else task(self.task, name=self.name, cache_policy=NO_CACHE)


def run_stages(run: PipelineRun, rows: list[Stage]) -> None:
    """Run each row that applies, in order; results in `run.results`, statuses in `run.stages`."""
    for stage in rows:
        if not stage.when(run):
            continue
        output = stage.output(run)
        # one writer per output: a second pipeline waits here, then finds the output done and reuses it
        with exclusive(lock_file(output), f"{stage.name} output {output}", run.cfg.pipeline.on_busy, _log_line):
            out = _run_row(run, stage, output)
        if stage.summary:
            artifacts.publish(f"{stage.name}-summary", stage.summary(run, out), stage.title, run.link)


def _run_row(run: PipelineRun, stage: Stage, output: Path) -> Outcome:
    """One row, its output locked by the caller: whether it is done is read only now."""
    done = stage.done(run, output)
    key = stage.key(run, output) if stage.key else cache_key(stage.name, output)
    sampled = stage.system_metrics and run.cfg.tracking.system_metrics and not done
    with tracking.stage_run(stage.name, system_metrics=sampled) as sid:
        run.sid = sid
        if stage.before:
            stage.before(run)
        result, cached = run_stage(stage.as_task(), key, done, *stage.args(run, output, key))
        result = run.results[stage.slot] = stage.read(result)
        out = Outcome(result, cached, done, output, key, sid)
        tracking.log_stage(sid, cached, **stage.tags(run, out))
        if sid and stage.log:
            stage.log(run, out)
    run.sid = None
    run.stages[stage.name] = stage.status(cached, done)
    if stage.after:
        stage.after(run, out)
    return out


def _log_line(line: str) -> None:
    try:
        get_run_logger().info(line)
    except MissingContextError:  # rows run outside a flow (a test, a script)
        print(line, flush=True)
