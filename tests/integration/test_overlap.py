"""Two pipelines at once: one writer per stage output, stores created once, deployments that never overlap
themselves (real processes, a real Prefect server)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from helpers import tiny_config
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Cancelling
from servers import BIN, stop

from difflm.data_prep.pipeline import data_dir
from difflm.locks import exclusive
from difflm.rundir import RunDir, exported_from, lock_file
from difflm.tasks.latest import export_newest
from difflm.tracking import tracking_uri

ROOT = Path(__file__).resolve().parents[2]


def _until(what, timeout: float, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every)
    pytest.fail(f"not reached within {timeout:.0f} s: {what.__doc__}")


@pytest.mark.slow(reason="a Prefect server, `difflm serve` and two flow runs, the second waiting for the first's slot")
def test_a_run_of_a_deployment_that_comes_while_one_runs_waits_for_it(tmp_path, prefect_server):
    """`difflm serve` with its concurrency limit of one; two runs triggered together: the second waits in
    AwaitingConcurrencySlot while the first runs, and starts only once the first ended. The first is held (cheaply)
    in its data prep by the test holding that output's lock, and then cancelled: no training needed."""
    server = prefect_server(PREFECT_RUNNER_POLL_FREQUENCY="1")
    workdir = tmp_path / "work"
    held = exclusive(lock_file(data_dir(tiny_config(workdir))), "data-prep output (the test)", "fail")
    log = tmp_path / "serve.log"
    serve = None
    with (
        held,
        temporary_settings({PREFECT_API_URL: server.env["PREFECT_API_URL"]}),
        get_client(sync_client=True) as client,
    ):
        try:
            serve = subprocess.Popen(
                [str(BIN / "difflm"), "serve", "pretrain-difflm", "--preset", "test-tiny", "--name", "once"]
                + [f"workdir={workdir}"],
                env=server.env,
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
            )

            def registered():
                """the deployment registered"""
                found = client.read_deployments()
                return found[0] if found else None

            deployment = _until(registered, 120)
            assert deployment.global_concurrency_limit and deployment.global_concurrency_limit.limit == 1
            assert deployment.concurrency_options.collision_strategy == "ENQUEUE"
            assert "one run at a time: a run that comes while one runs waits for it" in log.read_text()
            runs = [client.create_flow_run_from_deployment(deployment.id) for _ in range(2)]
            seen: dict[str, str] = {}

            def state(run: FlowRun) -> str:
                seen[str(run.id)] = client.read_flow_run(run.id).state.name
                return seen[str(run.id)]

            def one_waits_on_the_lock_and_the_other_queues():
                """one run waiting for the data-prep lock, the other awaiting a concurrency slot"""
                # the runner may take either of two runs scheduled in the same instant first (CI took the second)
                names = [state(r) for r in runs]
                return "is being written by" in log.read_text() and sorted(names) == [
                    "AwaitingConcurrencySlot",
                    "Running",
                ]

            try:
                _until(one_waits_on_the_lock_and_the_other_queues, 180)
            except BaseException:
                print(f"states: {seen}\nserve log:\n{log.read_text()[-4000:]}")
                raise
            first, second = sorted(runs, key=lambda r: state(r) != "Running")
            client.set_flow_run_state(first.id, Cancelling(), force=True)

            def second_runs():
                """the first run ended and the second one running"""
                return state(first) == "Cancelled" and state(second) == "Running"

            _until(second_runs, 120)
            ended, started = client.read_flow_run(first.id).end_time, client.read_flow_run(second.id).start_time
            assert ended is not None and started is not None and started >= ended
            client.set_flow_run_state(second.id, Cancelling(), force=True)
            _until(lambda: state(second) == "Cancelled", 120)
        finally:
            if serve:
                stop(serve)
    assert "Traceback" not in log.read_text()


# a short training that saves every step (keeping two), so a reader of "the latest checkpoint" races each save
EVERY_STEP = [
    "train.train_iters=8",
    "train.schedule.warmup_iters=1",
    "train.log_interval=1",
    "train.eval_interval=4",
    "train.eval_iters=1",
    "checkpoint.save_interval=1",
    "checkpoint.keep_last=2",
    "tracking.registry=false",
]


@pytest.mark.slow(
    reason="two `difflm run` pipelines on one workdir, each with its Prefect server, one training 8 steps"
)
def test_two_pipelines_on_one_workdir_train_once_and_latest_checkpoint_reads_only_complete_ones(tmp_path):
    """Two `difflm run` on one fresh workdir started together (tried as a new user would: both trained the same
    run directory, the MLflow store's migrations raced, the Prefect database's too): one trains, the other waits
    and reuses; each step once in metrics.jsonl; both runs in MLflow; no traceback. Meanwhile the test exports
    the latest checkpoint in a loop, as evaluate-latest does: every export is of a complete checkpoint."""
    workdir = tmp_path / "work"
    cfg = tiny_config(workdir, *EVERY_STEP)
    # temporary Prefect servers on one database; MLflow in the workdir's own store (not one a test left in the env)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API") and k != "MLFLOW_TRACKING_URI"}
    cli = [sys.executable, "-m", "difflm.flows.cli", "run", "--preset", "test-tiny", f"workdir={workdir}", *EVERY_STEP]
    outs = [tmp_path / f"out{i}.txt" for i in (1, 2)]
    procs = [subprocess.Popen(cli, cwd=ROOT, env=env, stdout=o.open("w"), stderr=subprocess.STDOUT) for o in outs]
    exported: list[int] = []
    try:
        while any(p.poll() is None for p in procs):
            runs = [RunDir(r) for r in (workdir / "runs").glob("*-*-*") if r.is_dir()]
            if runs and runs[0].has_inputs() and runs[0].latest_iteration() is not None:
                iteration, hf = export_newest(cfg, runs[0].manifest(), runs[0])
                assert exported_from(hf) == str(runs[0].checkpoint(iteration))  # a whole one, or it would not load
                exported.append(iteration)
            else:
                time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    texts = [o.read_text() for o in outs]
    for p, text in zip(procs, texts):
        assert p.returncode == 0 and "Traceback" not in text, text[-5000:]
    stages = [line for text in texts for line in text.splitlines() if line.startswith("stages:")]
    assert len(stages) == 2 and sum("train ran" in line for line in stages) == 1, stages
    assert any("is being written by pid" in text for text in texts)
    (run,) = [RunDir(r) for r in (workdir / "runs").iterdir() if r.is_dir()]
    steps = [r["step"] for r in run.metrics() if "loss" in r]
    assert sorted(steps) == sorted(set(steps)) and max(steps) == 8, steps
    assert exported and exported == sorted(exported), exported  # read beside the training, never going back

    os.environ.pop("MLFLOW_TRACKING_URI", None)  # the workdir's store, as the two processes used
    mlflow.set_tracking_uri(tracking_uri(cfg))
    client = MlflowClient()
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    found = client.search_runs([experiment.experiment_id], "tags.flow = 'pretrain-difflm'")
    parents = [r for r in found if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.status for r in parents] == ["FINISHED", "FINISHED"]
    assert all(r.data.tags.get("stage.train") for r in parents)


@pytest.mark.slow
def test_two_standalone_trains_of_one_config_prep_and_train_once(tmp_path):
    """Two `difflm train` of one config on a fresh workdir started together, no Prefect or MLflow (the commands of
    the data, training and conversion rooms alone used to take no lock: both ran the data prep into one folder and
    two trainers wrote one run directory). One preps and trains; the other waits, then reuses both. Then two
    `difflm convert` of the run at once: one export."""
    workdir = tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API") and k != "MLFLOW_TRACKING_URI"}
    base = [sys.executable, "-m", "difflm.flows.cli"]
    args = ["--preset", "test-tiny", f"workdir={workdir}", *EVERY_STEP]
    texts = _together([[*base, "train", *args]] * 2, tmp_path, env)
    # each stage once, by either process (the one that waited for the data may win the run's lock)
    assert sum(t.count("data prep: ") for t in texts) == 1, texts
    assert sum(t.count("[train] starting") for t in texts) == 1, texts
    assert sum(t.count("[train] reusing finished run") for t in texts) == 1, texts
    assert any("is being written by pid" in t for t in texts), texts
    (run,) = [RunDir(r) for r in (workdir / "runs").iterdir() if r.is_dir()]
    steps = [r["step"] for r in run.metrics() if "loss" in r]
    assert sorted(steps) == sorted(set(steps)) and max(steps) == 8, steps
    assert (run.path / "train.log").read_text().count("[train] mode=") == 1

    texts = _together([[*base, "convert", str(run.path)]] * 2, tmp_path, env)
    # one writes, the other reuses (after waiting for it, unless it started once the export was done)
    assert sum("(reused)" in t for t in texts) == 1, texts
    (export,) = [p for p in (run.path / "exports").iterdir() if p.is_dir()]  # and its lock file beside it
    assert exported_from(export) == str(run.checkpoint(8))


def _together(commands: list[list[str]], tmp_path: Path, env: dict) -> list[str]:
    """Start `commands` at once; their outputs, each asserted to have ended well."""
    outs = [tmp_path / f"together{i}.txt" for i in range(len(commands))]
    procs = [
        subprocess.Popen(c, cwd=ROOT, env=env, stdout=o.open("w"), stderr=subprocess.STDOUT)
        for c, o in zip(commands, outs)
    ]
    try:
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = [o.read_text() for o in outs]
    for p, text in zip(procs, texts):
        assert p.returncode == 0 and "Traceback" not in text, text[-5000:]
    return texts
