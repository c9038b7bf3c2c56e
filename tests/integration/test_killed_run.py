"""`kill -9` of a `difflm run`'s process group (issue 51, tried as a new user would): the temporary Prefect server
(in a session of its own) and torchrun with its ranks (in theirs) outlived it for good, with parent 1, and the
killed run's MLflow runs and Prefect flow run stayed RUNNING for ever. Now nothing of the run is left within 10 s
(the server dies with its parent; a reaper stops the rest), and the next command on the workdir marks the dead
run's MLflow runs and flow run failed, saying why."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import tiny_config
from mlflow.tracking import MlflowClient

from difflm.models.launch.torchrun import run_dir
from difflm.rundir import Workdir

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "difflm.flows.cli"]


def _when(predicate, timeout: float, every: float = 0.2) -> bool:
    end = time.time() + timeout
    while not predicate():
        if time.time() > end:
            return False
        time.sleep(every)
    return True


def _alive(p: psutil.Process) -> bool:
    """Running and not a zombie (a container's pid 1 may never reap the orphans it inherits)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _last_step(rdir: Path) -> int:
    lines = (rdir / "metrics.jsonl").read_text().splitlines() if (rdir / "metrics.jsonl").exists() else []
    steps = [json.loads(line).get("step", 0) for line in lines if line.strip().startswith("{")]
    return max(steps, default=0)


@pytest.mark.slow(reason="a difflm run killed while it trains, then the next command with its own Prefect server")
def test_kill9_of_a_runs_group_leaves_nothing_and_the_next_command_marks_it_failed(
    session_dir, tiny_manifest, tmp_path
):
    workdir = session_dir / "shared"  # the prepared data of tiny_manifest is reused
    # a run directory of its own (the save interval is part of its name), never finished
    overrides = ["train.train_iters=100000", "train.log_interval=1", "train.schedule.warmup_iters=2"]
    overrides += ["checkpoint.save_interval=1003", "tracking.registry=false"]
    rdir = run_dir(tiny_config(workdir, *overrides), tiny_manifest)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")  # the Prefect database of both commands
    out, err_file = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out.open("w") as stdout, err_file.open("w") as stderr:  # files: a full pipe would block the command
        proc = subprocess.Popen(
            [*CLI, "run", "--preset", "test-tiny", f"workdir={workdir}", *overrides],
            cwd=ROOT,
            env=env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # its own process group, as a terminal's job
        )
    family: list[psutil.Process] = []
    try:

        def training() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"difflm run exited {proc.returncode} before training:\n{err_file.read_text()[-3000:]}")
            return _last_step(rdir) >= 2

        assert _when(training, 600), "training never started"
        family = psutil.Process(proc.pid).children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in family]
        assert any("uvicorn" in c and "prefect" in c for c in commands), commands  # the temporary Prefect server
        assert any("torch.distributed.run" in c for c in commands), commands
        client = MlflowClient(f"sqlite:///{Workdir(workdir).mlflow_store}")
        running = client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            "attributes.status = 'RUNNING' and params.`checkpoint.save_interval` = '1003'",
        )
        assert len(running) == 1, running  # this command's pipeline run
        parent = running[0]
        flow_run_id = parent.data.tags["prefect.flow_run_id"]
        os.killpg(proc.pid, signal.SIGKILL)  # `kill -9 -- -PGID`: the group, not the sessions of its own
        proc.wait()
        left = lambda: [p for p in family if _alive(p)]  # noqa: E731
        assert _when(lambda: not left(), 10), [(p.pid, " ".join(p.cmdline())[:120]) for p in left()]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in family:  # never leave a server or a trainer behind, whatever failed
            if _alive(p):
                p.kill()

    nested = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    nested = [r for r in nested if r.info.status == "RUNNING"]  # the train stage's (data prep's had finished)
    assert [r.data.tags.get("stage") for r in nested] == ["train"], nested  # what the next command has to mark
    nxt = subprocess.run(
        [*CLI, "prep", "--flow", "--preset", "test-tiny", f"workdir={workdir}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert nxt.returncode == 0, nxt.stderr[-3000:]
    said = [ln for ln in (nxt.stdout + nxt.stderr).splitlines() if f"pid {proc.pid} " in ln]
    assert len(said) == 1 and "marked" in said[0] and "failed" in said[0], (nxt.stdout + nxt.stderr)[-3000:]
    for run in [parent, *nested]:
        got = client.get_run(run.info.run_id)
        assert got.info.status == "FAILED", (run.info.run_name, got.info.status)
        assert f"pid {proc.pid} " in got.data.tags.get("difflm.failure", ""), got.data.tags
    with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as db:
        (state,) = db.execute("select state_type from flow_run where id = ?", (flow_run_id,)).fetchone()
        tasks = db.execute("select state_type from task_run where flow_run_id = ?", (flow_run_id,)).fetchall()
    assert state == "FAILED", state
    assert tasks and "RUNNING" not in {t for (t,) in tasks}, tasks
