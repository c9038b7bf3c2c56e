"""Launch training as a `torchrun` subprocess: the same entry point runs by hand, under Prefect or Slurm.

The run directory is named by a hash of everything that determines the trained weights (data, model,
objective, training, parallel layout), so a finished run is reused, an interrupted one resumes from
its latest complete checkpoint, and a changed config trains into a new directory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import psutil

from difflm.config import PipelineConfig, save_config
from difflm.errors import (
    DiskFull,
    Interrupted,
    InvalidSetup,
    NonFiniteStop,
    TrainingError,
    TrainingPreempted,
    disk_full,
    is_disk_full,
)
from difflm.locks import exclusive
from difflm.manifest import DataManifest
from difflm.rundir import TRAIN_SECTIONS, RunDir, TrainResult, Workdir, lock_file
from difflm.tracking.plots import plot_curves

# where callers used to find them
__all__ = ["TRAIN_SECTIONS", "InvalidSetup", "NonFiniteStop", "TrainingError", "TrainingPreempted", "TrainResult"]


def run_dir(cfg: PipelineConfig, manifest: DataManifest) -> Path:
    """The path of the run `cfg` trains on the data of `manifest` (`Workdir.run_for`)."""
    return Workdir.of(cfg).run_for(cfg, manifest).path


def _as_run(run: RunDir | Path | str) -> RunDir:
    return run if isinstance(run, RunDir) else RunDir(run)


def is_finished(cfg: PipelineConfig, run: RunDir | Path) -> bool:
    return _as_run(run).is_finished(cfg.train.train_iters)


def write_run_inputs(cfg: PipelineConfig, manifest: DataManifest, run: RunDir) -> tuple[Path, Path]:
    """Write the files a trainer reads into its run directory: (config.yaml, data_manifest.json).
    The run records exactly the config and data it was given, whoever launches it."""
    run.path.mkdir(parents=True, exist_ok=True)
    manifest.write(run.manifest_file)
    return save_config(cfg, run.config_file), run.manifest_file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TRAINER = "difflm.models.megatron.train"  # the module torchrun runs on every rank


def trainer_args(config: Path, manifest: Path, run_dir: Path, trainer: str = TRAINER) -> list[str]:
    """`-m <trainer> --config ... --manifest ... --run-dir ...`: what every launcher runs on every node."""
    return ["-m", trainer, "--config", str(config), "--manifest", str(manifest), "--run-dir", str(run_dir)]


def torchrun_command(
    cfg: PipelineConfig, config_path: Path, manifest_path: Path, rdir: Path, trainer: str = TRAINER
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(cfg.train.launch.nproc_per_node),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        *trainer_args(config_path, manifest_path, rdir, trainer),
    ]


# Set to stop the trainers that worker threads launched (a study trains its points in threads): a signal reaches
# only the main thread, so the process's Ctrl-C or SIGTERM reaches those trainers through this flag instead. A
# trainer then stops as on a signal (checkpoint, exit 75), and no new one starts while it is set.
STOP = threading.Event()


def launch_training(
    cfg: PipelineConfig,
    manifest: DataManifest,
    env: dict[str, str] | None = None,
    echo: Callable[[str], None] = print,
    trainer: str = TRAINER,
) -> TrainResult:
    """Train (or reuse/resume) the run of `cfg`. `trainer`: the module torchrun runs, the trainer or an entry
    module that calls its `main` with more hooks (as tests do)."""
    run = Workdir.of(cfg).run_for(cfg, manifest)
    if cfg.train.launch.nnodes > 1:
        raise InvalidSetup(
            f"train.launch.nnodes={cfg.train.launch.nnodes}: multi-node runs are launched on the cluster: "
            f"train.launch.launcher=slurm|kubernetes, or write the launch file with `difflm launch "
            f"--target slurm|k8s` (same overrides)"
        )
    with one_launcher(cfg, run, echo):
        return _launch(cfg, manifest, run, env, echo, trainer)


def one_launcher(cfg: PipelineConfig, run: RunDir, echo: Callable[[str], None]) -> AbstractContextManager:
    """Within: this process alone launches `run` (every launcher takes it). A second launch of the same run
    (another terminal's `difflm train`, a pipeline) waits for the first and then reuses its run, or fails at once
    (`pipeline.on_busy`); two trainers writing one run directory would save the same iterations over each other."""
    return exclusive(lock_file(run.path), f"training run {run.path}", cfg.pipeline.on_busy, echo)


def _launch(cfg: PipelineConfig, manifest: DataManifest, run: RunDir, env, echo, trainer: str) -> TrainResult:
    rdir = run.path
    if is_finished(cfg, run):
        echo(f"[train] reusing finished run {rdir}")
        return TrainResult.of(cfg, run, reused=True)
    if STOP.is_set():  # the process is stopping: start nothing new
        raise KeyboardInterrupt
    resumed = prepare_attempt(run)
    config_path, manifest_path = write_run_inputs(cfg, manifest, run)
    cmd = torchrun_command(cfg, config_path, manifest_path, rdir, trainer)
    echo(f"[train] {'resuming from iteration ' + str(resumed) if resumed else 'starting'}: {' '.join(cmd)}")
    tail: deque[str] = deque(maxlen=25)
    errors: deque[str] = deque(maxlen=15)  # the ranks' own error lines, which torchrun's epilogue buries
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    # when a rank dies (kill -9, OOM), helper processes it spawned (checkpoint writers, in the rank's own
    # session) outlive it, holding the log pipe open: every descendant seen is killed once torchrun exits
    try:
        code = _run_trainer(cmd, run, full_env, tail, errors, echo)
    except OSError as err:
        if is_disk_full(err):
            raise _train_disk_full(run) from None
        raise
    if code == 0:
        plot_run(run)
    if code != 0:
        raise_for_markers(run, code)
        if any("No space left on device" in line or "Disk quota exceeded" in line for line in [*errors, *tail]):
            raise _train_disk_full(run)
        raise TrainingError(
            f"training failed (exit {code}); full log: {run.train_log}. Rerunning resumes from the "
            f"latest checkpoint. Errors from the ranks:\n" + "\n".join(errors or tail)
        )
    return TrainResult.of(cfg, run, reused=False)


def _train_disk_full(run: RunDir) -> DiskFull:
    last = run.latest_iteration()
    return disk_full(
        run.path,
        "training (saving a checkpoint or writing its log)",
        f"training resumes from {'iteration ' + str(last) if last else 'the start'}, the latest complete checkpoint",
    )


def _run_trainer(cmd, run: RunDir, full_env: dict, tail: deque, errors: deque, echo) -> int:
    """Run torchrun, its output pumped into <run>/train.log, `tail` and `errors`; its exit code."""
    with (
        run.train_log.open("a") as log,
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True
        ) as proc,
    ):
        pump = threading.Thread(target=_pump, args=(proc.stdout, log, tail, errors, echo), daemon=True)
        pump.start()
        family = _Descendants(proc.pid)
        received: list[signal.Signals] = []
        try:
            with _stop_signals(received):
                code = _wait(proc)
        except BaseException as stop:  # a signal or a cancelled task: the trainer checkpoints on it, then stops
            proc.send_signal(received[-1] if received else signal.SIGTERM)  # torchrun passes it to the ranks
            echo(f"[train] stopping: the trainer saves a checkpoint first (up to 120 s); {run.path}")
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
            family.kill_leftovers()
            if isinstance(stop, KeyboardInterrupt):  # one line with where to resume, not a traceback
                interrupted(run)
            raise
        family.kill_leftovers()
        pump.join(timeout=10)
    return code


def _wait(proc: subprocess.Popen) -> int:
    """The trainer's exit code; KeyboardInterrupt once STOP is set (a worker thread's Ctrl-C, so to speak)."""
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if STOP.is_set():
                raise KeyboardInterrupt from None


@contextmanager
def _stop_signals(received: list[signal.Signals]) -> Iterator[None]:
    """While the trainer runs, SIGINT (Ctrl-C) and SIGTERM (`kill`, a scheduler) to this process both raise
    KeyboardInterrupt here: both stop the trainer the same way (checkpoint, one line, exit 75); `received` gets
    the signal, which is forwarded as it came. (A SIGTERM otherwise ended the command in Prefect's crash
    handling, before the temporary server was stopped.) A signal ignored before stays ignored."""
    if threading.current_thread() is not threading.main_thread():  # handlers belong to the main thread
        yield
        return

    def on_signal(signum: int, _frame) -> None:
        received.append(signal.Signals(signum))
        raise KeyboardInterrupt

    sigs = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, on_signal) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def prepare_attempt(run: RunDir) -> int | None:
    """Before a new training attempt starts on `run`: the iteration it resumes from (None: from scratch);
    metrics of an earlier attempt that never checkpointed are dropped."""
    run.path.mkdir(parents=True, exist_ok=True)
    resumed = run.latest_iteration()
    if resumed is None:
        run.metrics_file.unlink(missing_ok=True)
    return resumed


def plot_run(run: RunDir) -> None:
    plot_curves(run.metrics(), run.curves, run.name)


def _pump(stream, log, tail: deque, errors: deque, echo) -> None:
    """Copy torchrun's output to train.log; keep the last lines and the ranks' errors; echo [train] lines."""
    try:
        for line in stream:
            log.write(line)
            log.flush()
            tail.append(line.rstrip())
            if line.startswith("[rank") and ("Error" in line or "error:" in line or 'File "' in line):
                errors.append(line.rstrip())
            if line.startswith("[train]"):
                echo(line.rstrip())
    except (ValueError, OSError):  # the pipe was closed under us: the run is over
        pass


class _Descendants:
    """Every process below `pid`, sampled twice a second while it runs (orphans leave the tree when their
    parent dies, so they must be seen before)."""

    def __init__(self, pid: int):
        self.root, self.seen, self.done = psutil.Process(pid), {}, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.5):
            try:
                for p in self.root.children(recursive=True):
                    self.seen.setdefault(p.pid, p)
            except psutil.Error:
                return

    def kill_leftovers(self) -> None:
        self.done.set()
        for p in self.seen.values():
            try:
                if p.is_running():  # also checks the start time: never a recycled pid
                    p.kill()
            except psutil.Error:
                pass


def raise_for_markers(run: RunDir, code: int | str | None, log: Path | None = None) -> None:
    """What the trainer left behind says why it stopped: preempted (resume me) or non-finite values. `code`: the
    exit status (or the cluster job's end state); `log`: the log to name (default: <run>/train.log)."""
    preempted, stopped = run.markers
    if preempted.exists():
        info = json.loads(preempted.read_text())
        raise TrainingPreempted(
            f"training preempted by {info.get('signal') or 'a signal'} at iteration "
            f"{info['iteration']}{f' (exit {code})' if code is not None else ''}; its checkpoint "
            f"is saved: rerun the same command to resume",
            info["iteration"],
        )
    if stopped.exists():
        raise NonFiniteStop(json.loads(stopped.read_text())["message"] + f"; full log: {log or run.train_log}")


def interrupted(run: RunDir) -> None:
    """After Ctrl-C or a SIGTERM: raise Interrupted naming the signal and the checkpoint the trainer saved (exit 75;
    rerun to resume)."""
    preempted, _ = run.markers
    if preempted.exists():
        info = json.loads(preempted.read_text())
        iteration, got = info["iteration"], f" ({info['signal']})" if info.get("signal") else ""
        raise Interrupted(
            f"interrupted at iteration {iteration}{got}; checkpoint saved: {run.checkpoint(iteration)}; "
            f"rerun the same command to resume",
            iteration,
        )


def read_metrics(run: RunDir | Path | str) -> list[dict]:
    return _as_run(run).metrics()
