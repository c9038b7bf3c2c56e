"""Fault injection on real processes: kill -9, SIGTERM, a tracking server that goes away, non-finite
values, a Prefect retry. Every interrupted run must end with exactly the weights of an uninterrupted one."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import psutil
import pytest
import torch
from fault_injection import fault_launch
from helpers import assert_same_weights, manifest_record, tiny_config, trained_overrides
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from mlflow.tracking import MlflowClient
from prefect import flow

from difflm import tracking
from difflm.errors import Interrupted
from difflm.models.hf.convert import load_megatron_weights
from difflm.models.launch import torchrun
from difflm.models.launch.torchrun import TrainingError, TrainingPreempted, launch_training, read_metrics, run_dir
from difflm.models.megatron.train import scheduler_kwargs
from difflm.rundir import RunDir, TrainResult
from difflm.tasks import stages
from difflm.tasks.stages import train_task
from difflm.tracking import degraded

ROOT = Path(__file__).resolve().parents[2]

# the shared masked run's settings (helpers.TRAINED: 16 steps, a checkpoint every 4, a log line a step): that run,
# trained once for the suite, is the uninterrupted reference of every interrupted run here
FAST = trained_overrides("masked")
# the first attempt of a run a test interrupts: 0.3 s before each step (the resume does not sleep; same weights).
# A step takes 11 ms on an idle machine, so a trainer could finish its last steps before a signal, a kill or STOP
# reached it (a clean-clone run on a loaded machine failed so)
SLOW_FIRST_ATTEMPT = fault_launch(step_sleep=0.3)


def _weights(info: TrainResult) -> dict[str, torch.Tensor]:
    return load_megatron_weights(info.checkpoint)


@pytest.fixture(scope="module")
def reference(trained):
    """The uninterrupted run every interrupted one must reproduce bit for bit: the shared masked run."""
    return _weights(trained("masked").info)


def _trainer_processes(launcher_pid: int) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(torchrun processes, training ranks) below this test process."""
    kids = psutil.Process(launcher_pid).children(recursive=True)
    torchrun = [p for p in kids if "torch.distributed.run" in " ".join(p.cmdline())]
    trainers = ("difflm.models.megatron.train", "fault_injection")  # the trainer, or it under tests/support's hooks
    ranks = [p for p in kids if any(t in " ".join(p.cmdline()) for t in trainers) and p not in torchrun]
    return torchrun, ranks


def _when(predicate, timeout: float = 120.0, every: float = 0.01) -> None:
    end = time.time() + timeout
    while not predicate():
        if time.time() > end:
            raise TimeoutError("condition not reached")
        time.sleep(every)


def _log_tail(rdir: Path, lines: int = 40) -> str:
    """The end of the run's train.log, for a failure's message (the run folder is gone by the time CI reports)."""
    log = rdir / "train.log"
    return "\n".join(log.read_text().splitlines()[-lines:]) if log.exists() else f"(no {log})"


def _last_step(rdir: Path) -> int:
    steps = [r["step"] for r in read_metrics(rdir) if "loss" in r]
    return max(steps, default=0)


def _in_background(fn):
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


@pytest.mark.slow
def test_kill9_during_training_and_during_a_save_then_rerun_gives_identical_weights(
    session_dir, tiny_manifest, reference
):
    cfg = tiny_config(session_dir / "faults-kill9", *FAST)
    rdir = run_dir(cfg, tiny_manifest)
    me = os.getpid()

    # 1. kill -9 a rank between checkpoints
    thread, out = _in_background(lambda: launch_training(cfg, tiny_manifest, echo=lambda _: None, **SLOW_FIRST_ATTEMPT))
    _when(lambda: _last_step(rdir) >= 6)
    for p in _trainer_processes(me)[1]:
        p.send_signal(signal.SIGKILL)
    thread.join()
    assert isinstance(out.get("error"), TrainingError), f"{out}\n{_log_tail(rdir)}"

    # 2. kill -9 while a checkpoint is being written (its folder exists, `latest` not yet moved)
    thread, out = _in_background(lambda: launch_training(cfg, tiny_manifest, echo=lambda _: None))
    _when(lambda: (rdir / "checkpoints" / "iter_0000012").exists(), every=0.001)
    for p in _trainer_processes(me)[1]:
        p.send_signal(signal.SIGKILL)
    thread.join()
    if "error" in out:  # (the save may just have finished: then the run completed)
        assert isinstance(out["error"], TrainingError)

    info = launch_training(cfg, tiny_manifest, echo=lambda _: None)
    assert re.search(r"start_iter=[1-9]", (rdir / "train.log").read_text())  # resumed, not restarted
    assert_same_weights(_weights(info), reference)


@pytest.mark.slow
def test_sigterm_checkpoints_exits_as_preempted_and_resumes_identically(session_dir, tiny_manifest, reference):
    cfg = tiny_config(session_dir / "faults-sigterm", *FAST)
    rdir = run_dir(cfg, tiny_manifest)
    thread, out = _in_background(lambda: launch_training(cfg, tiny_manifest, echo=lambda _: None, **SLOW_FIRST_ATTEMPT))
    _when(lambda: _last_step(rdir) >= 5)
    for p in _trainer_processes(os.getpid())[0]:  # as Kubernetes or a shell would: to torchrun
        p.send_signal(signal.SIGTERM)
    thread.join()
    err = out.get("error")
    assert isinstance(err, TrainingPreempted), f"{out}\n{_log_tail(rdir)}"
    assert 5 <= err.iteration < 16 and "rerun the same command to resume" in str(err)
    assert (rdir / "checkpoints" / f"iter_{err.iteration:07d}").is_dir()  # saved on the signal, not on schedule
    info = launch_training(cfg, tiny_manifest, echo=lambda _: None)
    assert_same_weights(_weights(info), reference)


@pytest.mark.slow
def test_stop_reaches_a_trainer_launched_from_a_worker_thread(session_dir, tiny_manifest, reference):
    """A study trains its points from threads, which signals never reach: the process's Ctrl-C sets
    torchrun.STOP instead, and the trainer stops as on a signal (checkpoint, Interrupted, exit 75); while it is set
    no trainer starts; a rerun resumes to the same weights."""
    cfg = tiny_config(session_dir / "faults-stop", *FAST)
    rdir = run_dir(cfg, tiny_manifest)
    # the launcher looks at STOP every 0.5 s: unslowed, the trainer finished all 16 steps before its next look
    thread, out = _in_background(lambda: launch_training(cfg, tiny_manifest, echo=lambda _: None, **SLOW_FIRST_ATTEMPT))
    try:
        _when(lambda: _last_step(rdir) >= 5)
        torchrun.STOP.set()
        thread.join(timeout=150)
        assert not thread.is_alive()
        err = out.get("error")
        assert isinstance(err, Interrupted) and "rerun the same command to resume" in str(err), out
        assert (rdir / "checkpoints" / f"iter_{err.iteration:07d}").is_dir()  # saved on the stop
        assert not _trainer_processes(os.getpid())[0]
        with pytest.raises(KeyboardInterrupt):  # still stopping: nothing new starts
            launch_training(cfg, tiny_manifest, echo=lambda _: None)
    finally:
        torchrun.STOP.clear()
    info = launch_training(cfg, tiny_manifest, echo=lambda _: None)
    assert_same_weights(_weights(info), reference)


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_or_stop_training(session_dir, tiny_manifest):
    cfg = tiny_config(session_dir / "faults-nan-skip", *FAST)
    info = launch_training(cfg, tiny_manifest, **fault_launch({6}), echo=lambda _: None)
    recs = read_metrics(info.run.path)
    assert [r["nonfinite_skipped"] for r in recs if "nonfinite_skipped" in r] == [1]
    final = [r["loss"] for r in recs if "loss" in r and r["step"] == 16]
    assert final and final[0] == final[0] and final[0] < 100  # finite: the bad update was never applied

    stop = tiny_config(session_dir / "faults-nan-stop", *FAST, "train.faults.on_nonfinite=stop")
    with pytest.raises(TrainingError, match="stopped at iteration 6: non-finite.*iteration 4, is kept"):
        launch_training(stop, tiny_manifest, **fault_launch({6}), echo=lambda _: None)

    limit = tiny_config(session_dir / "faults-nan-limit", *FAST, "train.faults.max_nonfinite_skips=2")
    with pytest.raises(TrainingError, match="stopped at iteration 7: .*3 step\\(s\\) in a row"):
        launch_training(limit, tiny_manifest, **fault_launch({5, 6, 7}), echo=lambda _: None)


@pytest.mark.slow
def test_an_attempt_resumed_from_an_older_checkpoint_logs_each_step_once(session_dir, tiny_manifest, trained):
    """An attempt killed between checkpoints leaves metrics.jsonl with steps the next attempt logs
    again. What the launcher leaves behind is made here by hand, from a copy of the finished shared run:
    checkpoint 8 the newest, metrics up to 16."""
    cfg = tiny_config(session_dir / "faults-relog", *FAST)
    rdir = run_dir(cfg, tiny_manifest)
    shutil.copytree(trained("masked").info.run.path, rdir, ignore=shutil.ignore_patterns("exports", "hf", "eval*"))
    for it in (12, 16):
        shutil.rmtree(rdir / "checkpoints" / f"iter_{it:07d}")
    (rdir / "checkpoints" / "latest").write_text("8")
    first = read_metrics(rdir)
    launch_training(cfg, tiny_manifest, echo=lambda _: None)
    records = read_metrics(rdir)
    pairs = [(k, r["step"]) for r in records for k in r if k not in ("step", "time")]
    assert len(pairs) == len(set(pairs)), sorted(p for p in pairs if pairs.count(p) > 1)
    assert [r for r in records if r["step"] <= 8] == [r for r in first if r["step"] <= 8]  # kept as they were
    later = [r for r in records if r["step"] > 8]
    assert later and min(r["time"] for r in later) > max(r["time"] for r in first)  # all from the new attempt
    assert {p for p in pairs} == {(k, r["step"]) for r in first for k in r if k not in ("step", "time")}


def test_lr_schedules():
    class Opt:  # the scheduler only writes param_groups
        param_groups = [{}]

    def curve(*over):
        cfg = tiny_config(
            Path("/tmp"),
            "train.train_iters=100",
            "train.schedule.warmup_iters=10",
            "train.optimizer.lr=1.0",
            "train.schedule.min_lr=0.1",
            *over,
        )
        sched = OptimizerParamScheduler(Opt(), **scheduler_kwargs(cfg))
        out = []
        for _ in range(100):
            sched.step(1)
            out.append(Opt.param_groups[0]["lr"])
        return out

    wsd = curve("train.schedule.lr_schedule=wsd", "train.schedule.wsd_decay_fraction=0.2")
    assert wsd[4] < 1.0 and all(v == pytest.approx(1.0) for v in wsd[10:80])  # warmup, then stable
    assert wsd[89] == pytest.approx(0.55, abs=0.02) and wsd[-1] == pytest.approx(0.1)  # linear decay to min
    const = curve("train.schedule.lr_schedule=constant")
    assert all(v == pytest.approx(1.0) for v in const[10:])
    lin, cos = curve("train.schedule.lr_schedule=linear"), curve()
    assert lin[54] == pytest.approx(0.55, abs=0.02) and cos[54] == pytest.approx(0.55, abs=0.02)
    assert lin[30] < cos[30] and lin[-1] == pytest.approx(0.1) and cos[-1] == pytest.approx(0.1)


@pytest.mark.slow
def test_tracking_outage_never_stops_training_and_nothing_is_lost(
    session_dir, tiny_manifest, mlflow_server, monkeypatch
):
    # mlflow.set_tracking_uri also sets $MLFLOW_TRACKING_URI: put it back for the tests that follow
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # records the original (unset) value for teardown
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setattr(degraded, "DEGRADED", [])  # where the functions read it

    server = mlflow_server()
    uri = server.url
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("faults")).info.run_id
    cfg = tiny_config(
        session_dir / "faults-mlflow",
        "train.train_iters=150",
        "train.log_interval=1",
        "train.eval_interval=50",
        "checkpoint.save_interval=50",
    )
    rdir = run_dir(cfg, tiny_manifest)
    env = {
        "MLFLOW_TRACKING_URI": uri,
        "DIFFLM_MLFLOW_RUN_ID": run_id,
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "2",
    }
    lines: list[str] = []
    thread, out = _in_background(lambda: launch_training(cfg, tiny_manifest, env=env, echo=lines.append))
    try:
        _when(lambda: _last_step(rdir) >= 10, timeout=180)
        server.kill()  # the tracking server dies mid-run ...
        down_at = _last_step(rdir)
        _when(lambda: _last_step(rdir) >= down_at + 15 or not thread.is_alive(), timeout=180)
        assert thread.is_alive() or "result" in out  # ... and training went on without it

        # the pipeline's own tracking calls do not fail either while it is down
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
        mlflow.set_tracking_uri(uri)
        assert tracking.log_data_stats(manifest_record("x")) is None
        assert degraded.DEGRADED

        server.start()  # ... and comes back, on the same store and port
        thread.join()
    finally:
        os.environ.pop("MLFLOW_HTTP_REQUEST_MAX_RETRIES", None)
        if thread.is_alive():
            thread.join()
    assert "result" in out, out.get("error")
    assert any("tracking degraded" in line for line in lines), lines[-10:]
    records = read_metrics(rdir)
    mlflow.set_tracking_uri(uri)
    tracking.reconcile_metrics(run_id, records)  # what the flow does after training
    assert tracking.reconcile_metrics(run_id, records) == 0  # idempotent: nothing left to send
    for key in ("loss", "lr", "tokens_per_s", "val_loss"):
        want = sorted(r["step"] for r in records if r.get(key) is not None)
        got = sorted(m.step for m in client.get_metric_history(run_id, key))
        assert got == want, key


@pytest.mark.slow
def test_prefect_retry_after_a_crash_resumes_training(session_dir, tiny_manifest, prefect_harness, monkeypatch):
    cfg = tiny_config(session_dir / "faults-prefect", *FAST)
    rdir = run_dir(cfg, tiny_manifest)

    def slowed(cfg, manifest, env=None, **kwargs):
        return launch_training(
            cfg,
            manifest,
            env={**(env or {}), **SLOW_FIRST_ATTEMPT["env"]},
            trainer=SLOW_FIRST_ATTEMPT["trainer"],
            **kwargs,
        )

    monkeypatch.setattr(stages, "launch_training", slowed)

    @flow
    def train_only():
        return train_task(cfg, tiny_manifest, {})

    def killer():
        _when(lambda: _last_step(rdir) >= 6)
        for p in _trainer_processes(os.getpid())[1]:
            p.send_signal(signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()
    info = train_only()
    log = (rdir / "train.log").read_text()
    assert re.search(r"start_iter=[1-9]", log) and info.checkpoint.name == "iter_0000016"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_during_difflm_run_exits_75_with_one_line_and_resumes(session_dir, tiny_manifest, tmp_path, sig):
    """Tried as a new user would: Ctrl-C during `difflm run` saved a checkpoint, then the command hung for minutes
    (Prefect's temporary server shared the terminal's process group and died first) and a second Ctrl-C printed
    about 120 lines of tracebacks. A SIGTERM (`kill`, a scheduler) ended in Prefect's "Crash detected!" and left the
    temporary server running with parent 1. Now, for both: one line naming the signal and the checkpoint, exit 75,
    within seconds, no process left behind; the trainer's log names the signal received."""
    workdir = session_dir / "shared"  # the prepared data of tiny_manifest is reused
    overrides = [
        "train.train_iters=100000",
        "train.log_interval=1",
        "train.schedule.warmup_iters=2",
    ]  # stopped long before
    # a run directory of its own for each signal (the save interval is part of the run's name), never reached
    overrides += [f"checkpoint.save_interval={1000 + int(sig == signal.SIGTERM)}", "tracking.registry=false"]
    rdir = run_dir(tiny_config(workdir, *overrides), tiny_manifest)  # this run's directory, not another test's
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    cli = [sys.executable, "-m", "difflm.flows.cli", "run", "--preset", "test-tiny", f"workdir={workdir}", *overrides]
    out, err_file = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out.open("w") as stdout, err_file.open("w") as stderr:  # files: a full pipe would block the command
        proc = subprocess.Popen(
            cli,
            cwd=ROOT,
            env=env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            # as a terminal's foreground job: SIGINT at its default (a suite started in the background by a
            # non-interactive shell inherits it ignored, and Python then never raises KeyboardInterrupt)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        _interrupt_and_check(proc, rdir, err_file, sig)
    finally:
        if proc.poll() is None:  # never leave a training behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _interrupt_and_check(proc: subprocess.Popen, rdir: Path, err_file: Path, sig: signal.Signals) -> None:

    def training() -> bool:
        if proc.poll() is not None:  # it ended before training: say why, not "condition not reached"
            pytest.fail(f"difflm run exited {proc.returncode} before training:\n{err_file.read_text()[-3000:]}")
        return (rdir / "metrics.jsonl").exists() and _last_step(rdir) >= 3

    _when(training, 600, every=0.2)
    started = psutil.Process(proc.pid).children(recursive=True)  # the Prefect server, torchrun, the ranks
    os.killpg(proc.pid, sig)  # Ctrl-C at a terminal, or `kill -- -PGID`: the whole group (its own here)
    t0 = time.time()
    proc.wait(timeout=300)
    took = time.time() - t0
    err = err_file.read_text()
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 75, err[-3000:]
    assert last.startswith("difflm: interrupted at iteration") and "rerun the same command" in last, err[-3000:]
    assert f"({sig.name})" in last, last
    assert "Traceback" not in err and "Crash detected" not in err, err[-5000:]
    assert [ln for ln in err.splitlines() if ln.startswith("difflm:")] == [last], err[-3000:]
    # Prefect's ERROR lines repeated the interrupt four times before that line; they go to the Prefect API only
    assert not [ln for ln in err.splitlines() if "ERROR" in ln and "nterrupt" in ln], err[-3000:]
    assert f"({sig.name} received)" in (rdir / "train.log").read_text()
    _when(lambda: not [p for p in started if p.is_running()], 15, every=0.2)  # nothing left behind
    assert took < 120, took  # the checkpoint is written, then the command ends (it hung for minutes before)
    iteration = int(re.search(r"interrupted at iteration (\d+)", last).group(1))
    assert (rdir / "checkpoints" / f"iter_{iteration:07d}").is_dir()
    assert RunDir(rdir).latest_iteration() == iteration  # where a rerun resumes (resume exactness: tests above)


@pytest.mark.integration
def test_a_temporary_prefect_server_too_slow_to_start_names_the_setting(tmp_path):
    """On a loaded machine the temporary server timed out with Prefect's own message, which names no setting. A
    one-second budget (the server takes seconds to import) makes it time out here: one line naming the setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1")
    cli = [sys.executable, "-m", "difflm.flows.cli", "prep", "--flow", "--preset", "test-tiny", f"workdir={tmp_path}"]
    proc = subprocess.run(cli, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("difflm: the temporary Prefect server did not answer within 1 s"), proc.stderr[-3000:]
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=<seconds>" in last
    assert "Traceback" not in proc.stderr and not (tmp_path / "data").exists()
