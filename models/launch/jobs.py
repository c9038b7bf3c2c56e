"""Waiting for a cluster job (a Slurm job, a Kubernetes PyTorchJob) that trains a run: one loop, `wait_for_job`.

Waiting is by polling (squeue / sacct, `kubectl get pytorchjob`), not `sbatch --wait`: a job submitted once is
recorded in its run directory, so a rerun of the flow (a retry, a restarted worker) reattaches to the job still
queued or running instead of submitting a second one into the same run directory; a job Slurm requeues
(preemption, the time limit) keeps its id and is simply waited for; and a slow controller is retried, not
mistaken for a failed job. Whether training finished is read from the run directory (the final checkpoint),
whatever the scheduler reports.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from difflm.config import PipelineConfig
from difflm.models.launch.torchrun import TrainingError, is_finished, plot_run
from difflm.rundir import RunDir, TrainResult

Echo = Callable[[str], None]


class ClusterError(TrainingError):
    """The cluster refused or lost the job for a reason a plain rerun would not fix (no sbatch/kubectl, a
    rejected submission, a job that never started): not retried by the train task."""


# ---- running commands ---------------------------------------------------------------------------------------


def run_command(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """`cmd` with captured text output; a missing program gives returncode 127, a hung one 124."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 120), **kw)
    except FileNotFoundError:
        return subprocess.CompletedProcess(cmd, 127, "", f"{cmd[0]}: command not found")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"{' '.join(cmd[:3])} ...: no answer in 120 s")


def missing(program: str, launcher: str, where: str) -> ClusterError:
    return ClusterError(
        f"`{program}` is not on the PATH of this process: train.launch.launcher={launcher} submits from "
        f"{where}. Run the flow (its Prefect worker) there, or train.launch.launcher=local"
    )


def output(proc: subprocess.CompletedProcess) -> str:
    return (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}")[-2000:]


# ---- following a job ----------------------------------------------------------------------------------------


class Deadline:
    def __init__(self, hours: float | None):
        self.end = time.monotonic() + hours * 3600 if hours else None

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() > self.end


class Follower:
    """New lines of a file that a job on another node appends to (shared filesystem), read at each poll."""

    def __init__(self, path: Path, from_end: bool = False):
        self.path, self.tail = path, deque(maxlen=25)
        self.errors: deque[str] = deque(maxlen=15)
        self.offset = path.stat().st_size if from_end and path.exists() else 0
        self.partial = ""

    def lines(self) -> list[str]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        self.offset += len(data)
        text = self.partial + data.decode(errors="replace")
        *done, self.partial = text.split("\n")
        for line in done:
            self.tail.append(line)
            if line.startswith("[rank") and ("Error" in line or "error:" in line or 'File "' in line):
                self.errors.append(line)
        return done


def echo_training_lines(follower: Follower, echo: Echo) -> None:
    """The trainer's own `[train]` lines and the batch script's `difflm:` lines, from the job's log."""
    for line in follower.lines():
        if line.startswith(("[train]", "difflm:")):
            echo(line)


def echo_metrics(follower: Follower, echo: Echo) -> None:
    """Progress lines made from the run's metrics.jsonl (when the job's log is not on shared storage)."""
    for line in follower.lines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "loss" in rec:
            echo(
                f"[train] iter {rec['step']}: loss {rec['loss']:.4f}"
                + (f" lr {rec['lr']:.2e}" if isinstance(rec.get("lr"), float) else "")
            )
        elif "val_loss" in rec:
            echo(f"[train] iter {rec['step']}: val_loss {rec['val_loss']:.4f}")


def not_finished(cfg: PipelineConfig, run: RunDir) -> str:
    last = run.latest_iteration()
    return (
        f"without the final checkpoint ({'latest: iteration ' + str(last) if last else 'no checkpoint yet'}, "
        f"of {cfg.train.train_iters})"
    )


class Job(Protocol):
    """One submitted cluster job, as `wait_for_job` sees it."""

    prefix: str  # "[slurm]", "[k8s]"
    label: str  # "job 12", "PyTorchJob difflm-..."
    stop: str  # the command that stops it
    poll_seconds: float
    wait_hours: float | None

    def poll(self) -> str | None:
        """Its state now; None when the scheduler did not answer (ask again)."""

    def is_over(self, state: str) -> bool: ...

    def describe(self, state: str) -> str:
        """The line echoed when the state changes."""

    def progress(self, echo: Echo) -> None:
        """Echo the training's new lines."""

    def check(self, state: str | None) -> None:
        """Raise ClusterError when waiting longer is pointless (a silent scheduler, a job that never starts)."""

    def still_running(self, state: str | None) -> ClusterError:
        """The error when the wait's deadline passed."""

    def failure(self, cfg: PipelineConfig, run: RunDir, state: str | None) -> Exception:
        """The error for a job over without the final checkpoint (after the trainer's markers were read)."""


def wait_for_job(cfg: PipelineConfig, run: RunDir, job: Job, echo: Echo) -> TrainResult:
    """Poll `job` until it is over, echoing its progress and state changes; the run's result when it left the
    final checkpoint, else the job's error. Waiting ended by something else (Ctrl-C, a cancelled flow) leaves
    the job running: a rerun reattaches to it."""
    deadline, shown, state = Deadline(job.wait_hours), None, None
    try:
        while True:
            state = job.poll()
            job.progress(echo)
            if state is not None and state != shown:
                echo(job.describe(state))
                shown = state
            if state is not None and job.is_over(state):
                break
            job.check(state)
            if deadline.passed():
                raise job.still_running(shown)
            time.sleep(job.poll_seconds)
    except BaseException as err:
        if not isinstance(err, ClusterError):
            echo(
                f"{job.prefix} stopped waiting; {job.label} keeps running (a rerun reattaches; to stop it: {job.stop})"
            )
        raise
    job.progress(echo)
    if is_finished(cfg, run):
        plot_run(run)
        echo(f"{job.prefix} {job.label} finished: {run.path}")
        return TrainResult.of(cfg, run, reused=False)
    raise job.failure(cfg, run, state)
