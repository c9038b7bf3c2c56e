"""The MLflow run context managers of difflm.tracking: a stage's own error always reaches the caller, with or
without tracking, and a stage run is a child of the pipeline run in the same experiment."""

import contextvars
import os
import subprocess
import sys
import threading
from pathlib import Path

import mlflow
import pytest
from helpers import tiny_config
from mlflow.tracking import MlflowClient

from difflm import tracking
from difflm.rundir import Workdir
from difflm.tracking import degraded


class StageFailed(Exception):
    pass


def test_errors_pass_through_without_tracking(tmp_path):
    with pytest.raises(StageFailed):  # no active run: the stage run is nothing, the error is the stage's
        with tracking.stage_run("train") as sid:
            assert sid is None
            raise StageFailed
    cfg = tiny_config(tmp_path, "tracking.enabled=false")
    with pytest.raises(StageFailed):
        with tracking.pipeline_run(cfg, "off", {}) as run_id:
            assert run_id is None
            raise StageFailed


@pytest.mark.integration  # an MLflow store
def test_stage_runs_nest_and_fail_with_their_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # set_tracking_uri exports it: restore after the test
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    cfg = tiny_config(tmp_path)
    with pytest.raises(StageFailed):
        with tracking.pipeline_run(cfg, "nest", {"flow": "t"}) as run_id:
            with tracking.stage_run("data-prep") as ok_id:
                tracking.log_stage(ok_id, cached=True, where="x")
            with tracking.stage_run("train") as bad_id:
                raise StageFailed
    client = MlflowClient()
    parent = client.get_run(run_id)
    children = {
        r.data.tags["stage"]: r
        for r in client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    }
    assert set(children) == {"data-prep", "train"} and children["train"].info.run_id == bad_id
    assert children["data-prep"].info.status == "FINISHED" and children["data-prep"].data.tags["cached"] == "true"
    assert children["train"].info.status == "FAILED" and parent.info.status == "FAILED"
    assert children["data-prep"].info.run_name == "nest/data-prep"
    assert mlflow.active_run() is None


@pytest.mark.integration  # two MLflow stores
def test_one_process_tracks_two_workdirs_into_their_own_stores(tmp_path, monkeypatch):
    """A long-lived `difflm serve` runs flows for two workdirs: each is tracked into its own store, and so is a
    process started after them (it inherits the variable). mlflow.set_tracking_uri exports the store as
    $MLFLOW_TRACKING_URI, which once passed for the user's choice and sent the second workdir's runs into the
    first's store. A URI the user exported still wins."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # restored after the test
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    first, second = tiny_config(tmp_path / "a"), tiny_config(tmp_path / "b")
    for cfg in (first, second):
        with tracking.pipeline_run(cfg, "serve", {"flow": "t"}) as run_id:
            assert run_id is not None
        assert tracking.tracking_uri(cfg) == f"sqlite:///{Workdir.of(cfg).mlflow_store}"
        assert MlflowClient(tracking.tracking_uri(cfg)).get_run(run_id).info.run_name == "serve"
    assert tracking.tracking_uri(first) != tracking.tracking_uri(second)
    # a process started now inherits the exported URI: it is still the pipeline's choice there, not the user's
    child = (
        "import sys; from difflm import tracking; from difflm.config import load_config; "
        "print(tracking.tracking_uri(load_config('test-tiny', [f'workdir={sys.argv[1]}'])))"
    )
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path / "c")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.stdout.strip() == f"sqlite:///{tmp_path / 'c' / Workdir.of(first).mlflow_store.name}", proc.stderr
    user = f"sqlite:///{tmp_path}/user.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", user)
    assert tracking.tracking_uri(first) == tracking.tracking_uri(second) == user


def test_each_execution_reports_only_its_own_tracking_failures(monkeypatch, capsys):
    """A study trains its points in threads of one process: a point whose MLflow calls failed said so in every
    other point's summary too (the list was the process's). Each execution now has its own; the process list
    still holds all, and each kind of failure is printed once per execution."""
    monkeypatch.setattr(degraded, "DEGRADED", [])
    seen: dict[str, list[str]] = {}

    def point(name: str, fails: int) -> None:
        with degraded.degradations() as notes:
            for _ in range(fails):
                degraded.degrade(f"could not log {name}", OSError("store unreachable"))
            seen[name] = list(notes)

    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(point, name, fails))
        for name, fails in (("a", 2), ("b", 0))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["b"] == [] and degraded.summary_line(seen["b"]) == "ok"
    assert seen["a"] == ["could not log a (OSError: store unreachable)"] * 2
    assert degraded.summary_line(seen["a"]).startswith("degraded: could not log a")
    assert len(degraded.DEGRADED) == 2  # the process's list: every execution's
    assert capsys.readouterr().out.count("tracking degraded: could not log a") == 1
