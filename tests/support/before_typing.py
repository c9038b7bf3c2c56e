"""The workdir the release before the typed records wrote (tests/fixtures/records_before_typing, see its README), put
back at a new place as if it had been written there."""

from __future__ import annotations

import shutil
from pathlib import Path

from difflm.flows.pretrain import CONVERT, DATA_PREP, EVALUATE, TRAIN
from difflm.flows.stages import PipelineRun, Stage
from difflm.manifest import DataManifest
from difflm.models.hf.export import Export
from difflm.rundir import EVAL_KEY, RunDir, TrainResult
from difflm.tasks.cache import cache_key

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "records_before_typing" / "wd"
PREFIX = "/work/before/wd"  # where it was written: every path inside its text files starts so
RUN = "runs/difflm-noshift-ae93725590ed-fec8076e2812"
DATA = "data/ae93725590ed"
STORAGE = ".prefect/storage"
# the Prefect records the four stages stored, by stage: the file name is the stage's cache key at PREFIX
STORED = {
    "data-prep": "data-prep-d3857f11e427eb6aa13c2515934d2ee0",
    "train": "train-bde9e13ab254e3c53149422bdc277d51",
    "convert": "convert-6833f076dd034587089d76af523d0e96",
    "evaluate": "evaluate-acb95d93c0e3a6d9f02ddaa1bd7ad5f7",
}
ROWS: tuple[Stage, ...] = (DATA_PREP, TRAIN, CONVERT, EVALUATE)


def _is_text(path: Path) -> bool:
    """The files that name paths as text (the checkpoint's .metadata pickle names its folder too: nothing reads it)."""
    return path.suffix in (".json", ".yaml", ".jsonl") or path.parent.name == "storage"


def relocate(dest: Path) -> Path:
    """A copy of the workdir at `dest`, its paths rewritten from PREFIX to `dest`, and what is keyed by a path keyed
    by the new one (the Prefect records' names, the evaluation's .cache_key): the workdir that release would have
    written at `dest`. The keys come from today's rows, which give the old names at PREFIX (test_records checks)."""
    shutil.copytree(FIXTURE, dest)
    for path in dest.rglob("*"):
        if path.is_file() and _is_text(path):
            path.write_text(path.read_text().replace(PREFIX, str(dest)))
    new = keys(typed_run(dest, at=dest))
    for stage, name in STORED.items():  # the record names its own storage key too
        record = dest / STORAGE / name
        (dest / STORAGE / new[stage]).write_text(record.read_text().replace(name, new[stage]))
        record.unlink()
    (dest / RUN / "eval" / EVAL_KEY).write_text(new["evaluate"] + "\n")
    return dest


def typed_run(workdir: Path, at: Path | None = None) -> PipelineRun:
    """A PipelineRun over the workdir's files as the stages would leave it, its paths those of `at` (default PREFIX:
    the paths the old release wrote; the files are read from `workdir`)."""
    at_ = str(at or PREFIX)
    run_dir = RunDir(Path(at_) / RUN)
    cfg = RunDir(workdir / RUN).config([f"workdir={at_}"])
    run = PipelineRun(cfg, None, None, {})
    run.manifest = DataManifest.of(
        {**DataManifest.read(workdir / DATA / "manifest.json").to_dict(), "dir": str(Path(at_) / DATA)}
    )
    run.trained = TrainResult.of(cfg, run_dir, reused=True)
    marker = Export.read(workdir / RUN / "hf").to_marker()
    run.export = Export.from_marker(run_dir.hf, {**marker, "checkpoint": str(run.trained.checkpoint)})
    return run


def keys(run: PipelineRun) -> dict[str, str]:
    """Each row's Prefect cache key for `run`, as `difflm.flows.stages` computes it."""
    out = {}
    for row in ROWS:
        output = row.output(run)
        out[row.name] = row.key(run, output) if row.key else cache_key(row.name, output)
    return out
