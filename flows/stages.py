"""The pipeline as a table of stages. A `Stage` row says what one stage runs, the folder it writes, when that
folder already holds its finished output, its Prefect cache key, what it tells MLflow and its Prefect summary;
`run_stages` runs rows in order inside the pipeline's MLflow run. `pretrain-difflm` and `adapt-difflm` are lists
of rows (flows/pretrain.py, flows/adapt.py); a new stage is a function, one row, and the typed attribute of
`PipelineRun` its result is kept under (a `Slot`: a row naming an undeclared one is refused where it is written,
and reading one before its stage ran raises `StageNotRun`, naming that stage). A row's `read` turns what Prefect
stored into that type, also a value stored by an earlier release (a path, a dict): a cache stays valid across one.

Every row behaves the same way: a nested MLflow run named after the stage (tags `cached` and the row's own), the
Prefect cache keyed by what names its output (`difflm.tasks.cache.run_stage`: a cache hit only while the output is on
disk), a status `ran` / `cached` / `reused`, and a markdown artifact `<name>-summary` linking the MLflow run. A row
holds its output's lock (`difflm.locks`) from the check of whether it is done to its `after` hook, so two
pipelines on one workdir never write the same folder: the second waits (or fails, `pipeline.on_busy`) and reuses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError

from difflm import tracking
from difflm.config import PipelineConfig
from difflm.errors import DiffLMError
from difflm.locks import exclusive
from difflm.manifest import DataManifest
from difflm.models.evaluation.record import EvalRecord
from difflm.models.hf.export import Export
from difflm.rundir import TrainResult, lock_file
from difflm.tasks import artifacts
from difflm.tasks.adapt import ImportedSource, source_folder, source_lineage
from difflm.tasks.cache import cache_key, run_stage

T = TypeVar("T")


def status(cached: bool, done: bool) -> str:
    """What a stage did: `cached` (Prefect skipped it), `reused` (it found its finished output), or `ran`."""
    return "cached" if cached else "reused" if done else "ran"


def ran_or_cached(cached: bool, done: bool) -> str:
    """The status of a stage whose task never reports a reuse of its own."""
    return "cached" if cached else "ran"


class StageNotRun(DiffLMError, AttributeError):
    """A stage's result was read before the stage that sets it ran (a row placed before it, or one its `when`
    skipped): the message names the attribute and the stage."""


class Slot(Generic[T]):
    """One stage's result on `PipelineRun`, typed: `run.<name>`, set by the row whose `slot` names it (the stage
    named `stage`); read before that row ran, it raises StageNotRun instead of a KeyError in the middle of a run."""

    def __init__(self, stage: str):
        self.stage = stage
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, run: None, owner: type) -> Slot[T]: ...
    @overload
    def __get__(self, run: PipelineRun, owner: type) -> T: ...
    def __get__(self, run: PipelineRun | None, owner: type) -> Slot[T] | T:
        if run is None:
            return self
        try:
            return run.__dict__[self.name]
        except KeyError:
            raise StageNotRun(
                f"run.{self.name} is not set: the `{self.stage}` stage sets it, and it has not run in this pipeline "
                f"(a row reading it must come after that row, and run whenever it runs)"
            ) from None

    def __set__(self, run: PipelineRun, value: T) -> None:
        run.__dict__[self.name] = value


@dataclass
class PipelineRun:
    """What the stages of one execution share: the config (a row may replace it: the import), the pipeline's
    MLflow run and its link, each stage's status, and each stage's result as a typed attribute (a `Slot`, named
    by the row's `slot`). A pipeline with a stage of its own declares its slot on a subclass."""

    cfg: PipelineConfig
    run_id: str | None
    link: str | None
    stages: dict[str, str]
    lineage: dict | None = None  # the HF source's `difflm.tasks.adapt.source_lineage`, when the run imports one
    sid: str | None = None  # the running stage's nested MLflow run (None: tracking off, or between stages)

    # the stages' results (flows/pretrain.py and flows/adapt.py)
    imported = Slot[ImportedSource]("import")  # the HF source's weights as a megatron checkpoint
    manifest = Slot[DataManifest]("data-prep")
    trained = Slot[TrainResult]("train")
    export = Slot[Export]("convert")  # the final checkpoint's HF export
    results = Slot[EvalRecord]("evaluate")  # its evaluation
    source_hf = Slot[Export]("export-source-ar")  # the imported source as an `ar` export
    source = Slot[EvalRecord]("evaluate-source-ar")  # its evaluation

    @classmethod
    def declares(cls, slot: str) -> bool:
        """Whether `slot` names a result attribute of this class or of one of its subclasses."""
        return isinstance(getattr(cls, slot, None), Slot) or any(sub.declares(slot) for sub in cls.__subclasses__())

    def source_lineage(self) -> dict:
        """The HF source's lineage (path, sha256, architecture: `adapt.source_lineage` of train.init_from_hf), read
        once per execution (hashing the source's weights is not free) unless the caller passed it in."""
        if self.lineage is None:
            self.lineage = source_lineage(source_folder(self.cfg))
        return self.lineage

    def has(self, slot: str) -> bool:
        """Whether the stage setting `slot` has run."""
        return slot in self.__dict__


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
    slot: str  # the `PipelineRun` attribute its result is kept under for later rows (a declared `Slot`)
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

    def __post_init__(self) -> None:
        # a typo fails where the row is written (at import), not in the middle of a run
        if not PipelineRun.declares(self.slot):
            declared = sorted(name for name, value in vars(PipelineRun).items() if isinstance(value, Slot))
            raise TypeError(
                f"stage {self.name!r}: slot {self.slot!r} is not a result attribute of PipelineRun ({', '.join(declared)}"
                f"); declare it there (or on a subclass of it) as a Slot"
            )

    def as_task(self) -> Task:
        return self.task if isinstance(self.task, Task) else task(self.task, name=self.name, cache_policy=NO_CACHE)


def run_stages(run: PipelineRun, rows: list[Stage]) -> None:
    """Run each row that applies, in order; each result in the run's attribute its row names, statuses in
    `run.stages`."""
    for stage in rows:
        if not isinstance(getattr(type(run), stage.slot, None), Slot):
            raise TypeError(f"stage {stage.name!r}: {type(run).__name__} has no slot {stage.slot!r}")
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
        result = stage.read(result)
        setattr(run, stage.slot, result)
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
