"""Slurm: the batch script for the trainer entry point (`torchrun ... -m difflm.models.megatron.train` on every node,
c10d rendezvous; the config and data manifest travel as files in the run directory on shared storage), and
`submit_slurm`, which submits it (or reattaches to the run's job), waits (`difflm.models.launch.jobs.wait_for_job`) and
returns the run's `TrainResult` as a local launch does."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from difflm.config import ConfigError, PipelineConfig, SlurmBase
from difflm.credentials import ENV_KEY, is_secret, job_environment, read_credentials, write_credentials_file
from difflm.manifest import DataManifest
from difflm.models.launch.jobs import (
    ClusterError,
    Follower,
    echo_training_lines,
    missing,
    not_finished,
    output,
    run_command,
    wait_for_job,
)
from difflm.models.launch.torchrun import (
    TRAINER,
    TrainingError,
    is_finished,
    one_launcher,
    prepare_attempt,
    raise_for_markers,
    trainer_args,
    write_run_inputs,
)
from difflm.rundir import RunDir, TrainResult, Workdir

RDZV_PORT_BASE = 20000  # + job id % 10000: a rendezvous port per job (jobs may share a node), below ephemeral ports
ROOT = Path(__file__).resolve().parent.parent.parent  # the project: `-m difflm.models.megatron.train` resolves here
SLURM_RECORD = "slurm-job.json"  # <run>/slurm-job.json: the job submitted for this run (reattached to)
LAUNCH_FILE = "launch.sbatch"
# what `train.launch.slurm.python` must answer to: only an interpreter prints `(3, 11)`
PYTHON_PROBE, PYTHON_PROBE_TIMEOUT = "import sys; print(sys.version_info[:2])", 30
# Jobs get an allow-list of the environment, and credentials never go into it (difflm/credentials.py): they go into a file only this user
# reads, in a private folder of the run, named to the job by path, read by the batch shell at start and removed
# when the job ends (not at a requeue: the requeued job reads it again).
CREDENTIALS_DIR, CREDENTIALS_FILE = ".credentials", "slurm-job.env"
CREDENTIALS_VAR = "DIFFLM_CREDENTIALS_FILE"  # the job's environment names the file, not what is in it

# squeue states of a job that is not over yet (a requeued job passes through REQUEUED and PENDING again)
SLURM_ACTIVE = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SUSPENDED",
    "STOPPED",
    "SIGNALING",
    "STAGE_OUT",
    "SPECIAL_EXIT",
    "RESV_DEL_HOLD",
    "POWER_UP_NODE",
}


def _directive_path(path: str) -> str:
    """A path in an #SBATCH line: sbatch splits directives at whitespace, and takes a double-quoted value whole
    (control characters and double quotes are refused before)."""
    return f'"{path}"' if any(c.isspace() for c in path) else path


def _check_script_values(run_dir: Path, env: dict[str, str] | None) -> None:
    """Refuse what would change the script's lines: a control character or double quote in a path of an
    `#SBATCH` line (the run directory comes from the workdir), an environment key that is not an identifier."""
    for where, path in (("workdir (the run directory)", run_dir), ("the project directory", ROOT)):
        if any(ord(c) < 32 or ord(c) == 127 or c == '"' for c in str(path)):
            raise ConfigError(
                f"{where} {str(path)!r} contains a control character or a double quote, which an #SBATCH "
                f"line cannot carry: use a plain path"
            )
    for key in env or {}:
        if not ENV_KEY.fullmatch(key):
            raise ConfigError(
                f"environment variable name {key!r} for the job is not an identifier ([A-Za-z_][A-Za-z0-9_]*)"
            )


def _check_python(python: str) -> None:
    """The job's python is a Python interpreter of this submitter's version, here (the nodes see the same
    shared filesystem): a typo, a path to something else (`/bin/sh` runs `-m torch.distributed.run` as a shell
    would) or an interpreter too old or too new is refused before anything is submitted. Checked by running it
    once with `-c` (this interpreter itself is known, and not run again)."""
    path = Path(python)
    field, fix = f"train.launch.slurm.python={python!r}", "give the absolute path of the python (with this project "
    fix += "installed) on the filesystem the nodes share"
    if not (path.is_absolute() and path.is_file() and os.access(path, os.X_OK)):
        raise ConfigError(f"{field} is not an executable file: {fix}")
    if os.path.realpath(path) == os.path.realpath(sys.executable):
        return
    try:
        done = subprocess.run(
            [python, "-c", PYTHON_PROBE], capture_output=True, text=True, timeout=PYTHON_PROBE_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{field} did not answer `-c` within {PYTHON_PROBE_TIMEOUT} s: {fix}") from None
    except OSError as err:
        raise ConfigError(f"{field} cannot be run ({err.strerror}): {fix}") from None
    found = re.fullmatch(r"\((\d+), (\d+)\)\n?", done.stdout) if done.returncode == 0 else None
    if not found:
        raise ConfigError(f"{field} is not a Python interpreter (`-c` did not print its version): {fix}")
    here = "{}.{}".format(*sys.version_info[:2])
    if f"{found[1]}.{found[2]}" != here:  # the job runs this project's code and reads what this python wrote
        raise ConfigError(f"{field} is Python {found[1]}.{found[2]}, not {here} as this submitter's python: {fix}")


def sbatch_options(cfg: PipelineConfig, partition: str | None = None, time: str | None = None) -> list[str]:
    """`train.launch.slurm`'s time, partition and sbatch_args as `sbatch` arguments (partition/time: these instead).
    They go on sbatch's command line, not into the script: a value never becomes a line of a file that a shell
    runs (validated all the same; a bad one is a ConfigError naming the field)."""
    s = cfg.train.launch.slurm
    partition, time = partition or s.partition, time or s.time
    try:  # the validators of train.launch.slurm, for values given as arguments
        SlurmBase(partition=partition, time=time, sbatch_args=dict(s.sbatch_args))
    except ValueError as err:
        raise ConfigError(f"train.launch.slurm: {err}") from None
    extra = [f"--{k}={v}" if str(v) != "" else f"--{k}" for k, v in s.sbatch_args.items()]
    return [f"--time={time}", *([f"--partition={partition}"] if partition else []), *extra]


def sbatch_command(cfg: PipelineConfig, script: Path, *flags: str) -> list[str]:
    """How to submit the run's script: `sbatch [flags] <train.launch.slurm options> script`."""
    return ["sbatch", *flags, *sbatch_options(cfg), str(script)]


def slurm_script(
    cfg: PipelineConfig,
    config: Path,
    manifest: Path,
    run_dir: Path,
    python: str | None = None,
    env: dict[str, str] | None = None,
    trainer: str = TRAINER,
) -> str:
    """An sbatch script: one torchrun per node, `train.launch.nproc_per_node` ranks each, `train.launch.nnodes` nodes; python
    defaults to `train.launch.slurm.python`, else this interpreter. Time, partition and sbatch_args are not in it: they
    are `sbatch` arguments (`sbatch_command`). `trainer`: the module torchrun runs (as in `launch_training`)."""
    t, s = cfg.train, cfg.train.launch.slurm
    python = python or s.python or sys.executable
    _check_python(python)
    gpus = t.launch.nproc_per_node if s.gpus_per_node is None else s.gpus_per_node
    _check_script_values(run_dir, env)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=difflm-{run_dir.name[:40]}",
        f"#SBATCH --nodes={t.launch.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={gpus}"] if gpus else []),
        f"#SBATCH --output={_directive_path(f'{run_dir}/slurm-%j.out')}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={_directive_path(str(ROOT))}",
        # preemption: train.launch.slurm.signal_seconds before the time limit (Slurm checks every 30 s and may send it up
        # to 60 s earlier), or on scancel --signal=USR1 -b, the batch shell gets
        # USR1, asks the trainer to checkpoint (SIGTERM to the job's steps: torchrun, which passes it to the
        # ranks), then requeues the job, which resumes from that checkpoint
        f"#SBATCH --signal=B:USR1@{s.signal_seconds}",
        "#SBATCH --requeue",
        "set -uo pipefail",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        # a port of its own per job: two jobs sharing a node must not meet at one rendezvous port
        f"MASTER_PORT=$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % 10000 ))",
        # which nodes met where: the first thing to read in the log of a multi-node job that does not start
        'echo "difflm: job $SLURM_JOB_ID on $SLURM_NNODES node(s) $SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR:$MASTER_PORT"',
        "export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1",
        *(f"export {k}={shlex.quote(v)}" for k, v in (env or {}).items() if not is_secret(k, v)),
        # credentials: from the file the submitter wrote (mode 0600), never from the job's stored environment
        f'if [ -n "${{{CREDENTIALS_VAR}:-}}" ]; then',
        f"  {read_credentials(CREDENTIALS_VAR)}",
        "fi",
        "preempted=0",
        # `scancel --signal=TERM JOB` reaches the steps (torchrun) and not this shell; a SIGTERM to srun itself
        # would make srun kill the step at once (`srun: forcing job termination`), losing the checkpoint
        'trap \'preempted=1; echo "difflm: preemption signal: checkpointing"; scancel --signal=TERM "$SLURM_JOB_ID"\' USR1 TERM',
        "srun "
        + " ".join(
            [
                shlex.quote(python),
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "$SLURM_NNODES",
                "--nproc_per_node",
                str(t.launch.nproc_per_node),
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                "$MASTER_ADDR:$MASTER_PORT",
                "--rdzv_id",
                "$SLURM_JOB_ID",
                *(shlex.quote(a) for a in trainer_args(config, manifest, run_dir, trainer)),
            ]
        )
        + " &",
        "trainer=$!",
        'wait "$trainer"; status=$?',
        'while kill -0 "$trainer" 2>/dev/null; do wait "$trainer"; status=$?; done  # a trap interrupts wait',
        # a signal that comes after the last step finds the run finished (exit 0): nothing to requeue
        f'if [ "$status" != 0 ] && {{ [ "$preempted" = 1 ] || [ -f {shlex.quote(str(RunDir(run_dir).preempted))} ]; }}; then',
        '  echo "difflm: requeueing job $SLURM_JOB_ID to resume from the checkpoint"; scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        f'[ -n "${{{CREDENTIALS_VAR}:-}}" ] && rm -f "${CREDENTIALS_VAR}"  # the job is over',
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def write_slurm_file(
    cfg: PipelineConfig, manifest: DataManifest, env: dict[str, str] | None = None, trainer: str = TRAINER
) -> Path:
    """Write the run's inputs and its `launch.sbatch`; returns the script (what `difflm launch --target slurm`
    writes and `submit_slurm` submits)."""
    run = Workdir.of(cfg).run_for(cfg, manifest)
    config, manifest_path = write_run_inputs(cfg, manifest, run)
    out = run.path / LAUNCH_FILE
    out.write_text(slurm_script(cfg, config, manifest_path, run.path, env=env, trainer=trainer))
    return out


def credentials_file(run: RunDir) -> Path:
    return run.path / CREDENTIALS_DIR / CREDENTIALS_FILE


def write_credentials(run: RunDir, env: dict[str, str] | None) -> dict[str, str]:
    """Move the credentials of this process's environment and `env` into the run's credentials file; the
    environment for `sbatch`: the allow-list of this process's (difflm.credentials.job_environment), naming the
    file. No credentials: no file."""
    clean, secret = job_environment(os.environ)
    secret.update({k: v for k, v in (env or {}).items() if is_secret(k, v)})  # `env`'s others: the script's exports
    path = credentials_file(run)
    return {**clean, CREDENTIALS_VAR: str(path)} if write_credentials_file(path, secret) else clean


def slurm_job_state(job_id: str) -> tuple[str | None, str | None]:
    """(state, exit code as 'code:signal' when accounting knows it). state is None when Slurm could not be asked
    (ask again later) and 'UNKNOWN' when neither squeue nor sacct knows the job."""
    q = run_command(["squeue", "-j", job_id, "-h", "-o", "%T"])
    if q.returncode == 127:
        raise missing("squeue", "slurm", "a Slurm login node")
    state = q.stdout.split()[0] if q.returncode == 0 and q.stdout.strip() else None
    if state in SLURM_ACTIVE:
        return state, None
    if state is None and q.returncode != 0 and "invalid job id" not in output(q).lower():
        return None, None  # the controller did not answer: not a verdict on the job
    a = run_command(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"])  # accounting may be absent
    rows = [r.split("|") for r in a.stdout.splitlines() if "|" in r] if a.returncode == 0 else []
    if rows:
        acct_state = rows[-1][0].split()[0] if rows[-1][0].strip() else "UNKNOWN"  # "CANCELLED by 1000"
        return state or acct_state, rows[-1][1].strip() or None
    # no accounting: the controller still holds a finished job for MinJobAge (300 s by default)
    ctl_state, code = _scontrol_job(job_id)
    return state or ctl_state or "UNKNOWN", code


def _scontrol_job(job_id: str) -> tuple[str | None, str | None]:
    """(JobState, ExitCode) from `scontrol show job -o`, (None, None) when the controller does not know the job."""
    proc = run_command(["scontrol", "show", "job", "-o", job_id])
    if proc.returncode != 0:
        return None, None
    fields = dict(f.split("=", 1) for f in proc.stdout.split() if "=" in f)
    return fields.get("JobState"), fields.get("ExitCode")


def _slurm_reattach(run: RunDir) -> tuple[str, str] | None:
    """(job id, state) of the job recorded for this run when it is still queued or running."""
    record = run.path / SLURM_RECORD
    if not record.exists():
        return None
    job_id = str(json.loads(record.read_text())["job_id"])
    state, _ = slurm_job_state(job_id)
    return (job_id, state) if state in SLURM_ACTIVE else None


class SlurmJob:
    """A submitted Slurm job as `wait_for_job` follows it: squeue/sacct for its state, its log for progress."""

    prefix = "[slurm]"

    def __init__(self, cfg: PipelineConfig, job_id: str, log: Path, reattached: bool):
        self.job_id, self.log, self.settings = job_id, log, cfg.train.launch.slurm
        self.label, self.stop = f"job {job_id}", f"scancel {job_id}"
        wait = cfg.train.launch.wait
        self.poll_seconds, self.wait_hours = wait.poll_seconds, wait.wait_hours
        self.follower = Follower(log, from_end=reattached)
        self.code: str | None = None
        self.unanswered = 0

    def poll(self) -> str | None:
        state, self.code = slurm_job_state(self.job_id)
        self.unanswered = self.unanswered + 1 if state is None else 0
        return state

    def is_over(self, state: str) -> bool:
        return state not in SLURM_ACTIVE

    def describe(self, state: str) -> str:
        held = state in ("REQUEUE_HOLD", "SPECIAL_EXIT")
        return f"[slurm] job {self.job_id}: {state}" + (f" (held: scontrol release {self.job_id})" if held else "")

    def progress(self, echo: Callable[[str], None]) -> None:
        echo_training_lines(self.follower, echo)

    def check(self, state: str | None) -> None:
        if self.unanswered * self.poll_seconds > 3600:
            raise ClusterError(
                f"Slurm has not answered squeue about job {self.job_id} for an hour: check the "
                f"controller; the job may still run (log: {self.log}); a rerun reattaches to it"
            )

    def still_running(self, state: str | None) -> ClusterError:
        return ClusterError(
            f"Slurm job {self.job_id} is still {state} after train.launch.wait.wait_hours="
            f"{self.wait_hours}; it keeps running (log: {self.log}). Rerun to wait again (reattaches) "
            f"or stop it: scancel {self.job_id}"
        )

    def failure(self, cfg: PipelineConfig, run: RunDir, state: str | None) -> Exception:
        raise_for_markers(run, self.code, self.log)
        code, job_id = self.code, self.job_id
        return TrainingError(
            f"Slurm job {job_id} ended {state}" + (f" (exit {code})" if code else "") + f" {not_finished(cfg, run)}; "
            f"log: {self.log}. Rerunning submits a new job that resumes from the latest checkpoint (sacct -j "
            f"{job_id} for the scheduler's side). Last lines of the log:\n"
            + "\n".join(self.follower.errors or self.follower.tail)
        )


def submit_slurm(
    cfg: PipelineConfig,
    manifest: DataManifest,
    echo: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
    trainer: str = TRAINER,
) -> TrainResult:
    """Train the run of `cfg` as a Slurm job (`train.launch.slurm`): reuse a finished run, reattach to its job when one is
    still queued or running, else write `launch.sbatch` (as `difflm launch`) and submit it; wait, echo progress
    and return the run's result as `launch_training`. The run directory must be on a filesystem the compute
    nodes share with this process. `trainer`: the module torchrun runs (`launch_training`)."""
    run = Workdir.of(cfg).run_for(cfg, manifest)
    with one_launcher(cfg, run, echo):
        return _submit_and_wait(cfg, manifest, run, echo, env, trainer)


def _submit_and_wait(cfg: PipelineConfig, manifest: DataManifest, run: RunDir, echo, env, trainer: str) -> TrainResult:
    if is_finished(cfg, run):
        echo(f"[train] reusing finished run {run.path}")
        return TrainResult.of(cfg, run, reused=True)
    found = _slurm_reattach(run)
    if found:
        job_id, state = found
        echo(f"[slurm] job {job_id} of this run is still {state}: waiting for it instead of submitting another")
    else:
        job_id = _submit(cfg, manifest, run, env, trainer, echo)
    log = run.path / f"slurm-{job_id}.out"
    echo(f"[slurm] job log: {log}")
    try:
        result = wait_for_job(cfg, run, SlurmJob(cfg, job_id, log, reattached=bool(found)), echo)
    except Exception as err:
        if not isinstance(err, ClusterError):  # the job is over; one that may still run still needs the file
            credentials_file(run).unlink(missing_ok=True)
        raise
    credentials_file(run).unlink(missing_ok=True)  # the job removed it too, unless it was killed
    return result


def _submit(cfg: PipelineConfig, manifest: DataManifest, run: RunDir, env, trainer: str, echo) -> str:
    """Write the run's script and sbatch it; the job id (recorded in the run directory for a rerun to reattach)."""
    resumed = prepare_attempt(run)
    script = write_slurm_file(cfg, manifest, env, trainer)
    sub = run_command(sbatch_command(cfg, script, "--parsable"), cwd=ROOT, env=write_credentials(run, env))
    if sub.returncode == 127:
        raise missing("sbatch", "slurm", "a Slurm login node")
    if sub.returncode != 0 or not sub.stdout.strip():
        raise ClusterError(
            f"sbatch did not take {script}: {output(sub)}\nFix train.launch.slurm.* (partition, time, "
            f"gpus_per_node, sbatch_args) and rerun; `difflm launch --target slurm` writes the same "
            f"script to try by hand"
        )
    job_id = sub.stdout.strip().splitlines()[-1].split(";")[0]
    (run.path / SLURM_RECORD).write_text(
        json.dumps({"job_id": job_id, "script": str(script), "submitted": time.time()})
    )
    echo(
        f"[slurm] submitted job {job_id} ({'resuming from iteration ' + str(resumed) if resumed else 'starting'})"
        f": {script}"
    )
    return job_id
