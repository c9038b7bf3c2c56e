"""Cluster launch files for the same trainer entry point: a Slurm batch script and a Kubernetes PyTorchJob
(Kubeflow training operator). Both run `torchrun ... -m models.megatron.train` on every node with c10d
rendezvous; the config and data manifest travel as files in the run directory (shared storage).

`write_launch_file` writes them (`difflm launch`); `submit_slurm` / `submit_kubernetes` also submit them, wait
for the job and return what `launch_training` returns, read from the run directory (`train.launcher`).

Waiting is by polling (squeue / sacct, `kubectl get pytorchjob`), not `sbatch --wait`: a job submitted once is
recorded in its run directory, so a rerun of the flow (a retry, a restarted worker) reattaches to the job still
queued or running instead of submitting a second one into the same run directory; a job Slurm requeues
(preemption, the time limit) keeps its id and is simply waited for; and a slow controller is retried, not
mistaken for a failed job. Whether training finished is read from the run directory (the final checkpoint),
whatever the scheduler reports.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import yaml

from difflm.config import ConfigError, PipelineConfig, SlurmBase
from difflm.rundir import RunDir
from models.launch.torchrun import (
    TRAINER,
    TrainingError,
    is_finished,
    plot_run,
    prepare_attempt,
    raise_for_markers,
    run_dir,
    train_info,
    write_run_inputs,
)

RDZV_PORT_BASE = 20000  # + job id % 10000: a rendezvous port per job (jobs may share a node), below ephemeral ports
ROOT = Path(__file__).resolve().parent.parent.parent  # the project: `-m models.megatron.train` resolves here
SLURM_RECORD = "slurm-job.json"  # <run>/slurm-job.json: the job submitted for this run (reattached to)
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
LAUNCH_FILES = {"slurm": "launch.sbatch", "kubernetes": "pytorchjob.yaml"}

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
K8S_FINAL = {"Succeeded", "Failed"}


class ClusterError(TrainingError):
    """The cluster refused or lost the job for a reason a plain rerun would not fix (no sbatch/kubectl, a
    rejected submission, a job that never started): not retried by the train task."""


def _train_args(config: Path, manifest: Path, run_dir: Path, trainer: str = TRAINER) -> list[str]:
    return [
        "-m",
        trainer,
        "--config",
        str(config),
        "--manifest",
        str(manifest),
        "--run-dir",
        str(run_dir),
    ]


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


def sbatch_options(cfg: PipelineConfig, partition: str | None = None, time: str | None = None) -> list[str]:
    """`train.slurm`'s time, partition and sbatch_args as `sbatch` arguments (partition/time: these instead).
    They go on sbatch's command line, not into the script: a value never becomes a line of a file that a shell
    runs (validated all the same; a bad one is a ConfigError naming the field)."""
    s = cfg.train.slurm
    partition, time = partition or s.partition, time or s.time
    try:  # the validators of train.slurm, for values given as arguments
        SlurmBase(partition=partition, time=time, sbatch_args=dict(s.sbatch_args))
    except ValueError as err:
        raise ConfigError(f"train.slurm: {err}") from None
    extra = [f"--{k}={v}" if str(v) != "" else f"--{k}" for k, v in s.sbatch_args.items()]
    return [f"--time={time}", *([f"--partition={partition}"] if partition else []), *extra]


def sbatch_command(cfg: PipelineConfig, script: Path, *flags: str) -> list[str]:
    """How to submit the run's script: `sbatch [flags] <train.slurm options> script`."""
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
    """An sbatch script: one torchrun per node, `train.nproc_per_node` ranks each, `train.nnodes` nodes; python
    defaults to `train.slurm.python`, else this interpreter. Time, partition and sbatch_args are not in it: they
    are `sbatch` arguments (`sbatch_command`). `trainer`: the module torchrun runs (as in `launch_training`)."""
    t, s = cfg.train, cfg.train.slurm
    python = python or s.python or sys.executable
    gpus = t.nproc_per_node if s.gpus_per_node is None else s.gpus_per_node
    _check_script_values(run_dir, env)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=difflm-{run_dir.name[:40]}",
        f"#SBATCH --nodes={t.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={gpus}"] if gpus else []),
        f"#SBATCH --output={_directive_path(f'{run_dir}/slurm-%j.out')}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={_directive_path(str(ROOT))}",
        # preemption: train.slurm.signal_seconds before the time limit (Slurm checks every 30 s and may send it up
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
        *(f"export {k}={shlex.quote(v)}" for k, v in (env or {}).items()),
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
                str(t.nproc_per_node),
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                "$MASTER_ADDR:$MASTER_PORT",
                "--rdzv_id",
                "$SLURM_JOB_ID",
                *(shlex.quote(a) for a in _train_args(config, manifest, run_dir, trainer)),
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
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def pytorchjob_name(run_dir: Path) -> str:
    """`difflm-<data hash[:8]>-<train hash>`: unique per run directory name, within Kubernetes' name limits."""
    parts = run_dir.name.rsplit("-", 2)
    return ("difflm-" + (f"{parts[1][:8]}-{parts[2]}" if len(parts) == 3 else run_dir.name[-12:])).lower()


def k8s_pytorchjob(
    cfg: PipelineConfig,
    config: Path,
    manifest: Path,
    run_dir: Path,
    image: str | None = None,
    pvc: str | None = None,
    mount: str | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """A Kubeflow PyTorchJob: 1 master + (nnodes - 1) workers, `train.nproc_per_node` ranks per pod.
    image/pvc/mount default to `train.kubernetes.*`."""
    t, k = cfg.train, cfg.train.kubernetes
    gpus = t.nproc_per_node if k.gpus_per_pod is None else k.gpus_per_pod
    container = {
        "name": "pytorch",
        "image": image or k.image,
        "command": [
            "torchrun",
            "--nnodes",
            str(t.nnodes),
            "--nproc_per_node",
            str(t.nproc_per_node),
            *_train_args(config, manifest, run_dir),
        ],
        "env": [
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            *({"name": key, "value": value} for key, value in (env or {}).items()),
        ],
        **({"resources": {"limits": {"nvidia.com/gpu": gpus}}} if gpus else {}),
        "volumeMounts": [{"name": "data", "mountPath": mount or k.mount}],
    }
    # on eviction Kubernetes sends SIGTERM and waits this long: the trainer checkpoints, and the restarted
    # pod (restartPolicy OnFailure) resumes from it
    pod = {
        "spec": {
            "containers": [container],
            "terminationGracePeriodSeconds": 180,
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": pvc or k.pvc}}],
        }
    }
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
    if t.nnodes > 1:
        replicas["Worker"] = {"replicas": t.nnodes - 1, "restartPolicy": "OnFailure", "template": pod}
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": pytorchjob_name(run_dir), **({"namespace": k.namespace} if k.namespace else {})},
        "spec": {"pytorchReplicaSpecs": replicas},
    }
    return yaml.safe_dump(job, sort_keys=False)


def write_launch_file(
    cfg: PipelineConfig, manifest: dict, target: str, env: dict[str, str] | None = None, trainer: str = TRAINER
) -> Path:
    """Write the run's inputs (config.yaml, data_manifest.json) and its launch file for `target` (slurm |
    kubernetes) into the run directory; returns the launch file. What `difflm launch` writes and what the
    cluster launchers submit."""
    rdir = run_dir(cfg, manifest)
    config, manifest_path = write_run_inputs(cfg, manifest, rdir)
    out = rdir / LAUNCH_FILES[target]
    if target == "slurm":
        out.write_text(slurm_script(cfg, config, manifest_path, rdir, env=env, trainer=trainer))
    else:
        out.write_text(k8s_pytorchjob(cfg, config, manifest_path, rdir, env=env))
    return out


def mount_problem(cfg: PipelineConfig, rdir: Path) -> str | None:
    """Why the pods would not see `rdir` at the same path (None: they would)."""
    mount = Path(cfg.train.kubernetes.mount)
    if mount in rdir.parents:
        return None
    return (
        f"the run directory {rdir} is not under train.kubernetes.mount={mount}, where the pods mount the "
        f"claim {cfg.train.kubernetes.pvc}: set workdir under it (e.g. workdir={mount / 'difflm'}), with the "
        f"claim mounted at that path wherever the pipeline runs"
    )


# ---- running commands ---------------------------------------------------------------------------------------


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """`cmd` with captured text output; a missing program gives returncode 127, a hung one 124."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 120), **kw)
    except FileNotFoundError:
        return subprocess.CompletedProcess(cmd, 127, "", f"{cmd[0]}: command not found")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"{' '.join(cmd[:3])} ...: no answer in 120 s")


def _missing(program: str, launcher: str, where: str) -> ClusterError:
    return ClusterError(
        f"`{program}` is not on the PATH of this process: train.launcher={launcher} submits from "
        f"{where}. Run the flow (its Prefect worker) there, or train.launcher=local"
    )


def _output(proc: subprocess.CompletedProcess) -> str:
    return (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}")[-2000:]


class _Deadline:
    def __init__(self, hours: float | None):
        self.end = time.monotonic() + hours * 3600 if hours else None

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() > self.end


class _Follower:
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


def _echo_training_lines(follower: _Follower, echo: Callable[[str], None]) -> None:
    for line in follower.lines():
        if line.startswith(("[train]", "difflm:")):
            echo(line)


def _echo_metrics(follower: _Follower, echo: Callable[[str], None]) -> None:
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


def _not_finished(cfg: PipelineConfig, rdir: Path) -> str:
    last = RunDir(rdir).latest_iteration()
    return (
        f"without the final checkpoint ({'latest: iteration ' + str(last) if last else 'no checkpoint yet'}, "
        f"of {cfg.train.train_iters})"
    )


# ---- Slurm --------------------------------------------------------------------------------------------------


def _left_running(err: BaseException, echo: Callable[[str], None], what: str, stop: str) -> None:
    """Waiting for a job ended by something else than the job (Ctrl-C, a cancelled flow): the job goes on."""
    if not isinstance(err, ClusterError):
        echo(f"{what} keeps running (a rerun reattaches; to stop it: {stop})")


def _finished(cfg: PipelineConfig, rdir: Path, echo: Callable[[str], None], what: str) -> dict:
    """What a local launch returns, for a run a cluster job has just finished."""
    plot_run(rdir)
    echo(f"{what} finished: {rdir}")
    return train_info(cfg, rdir, reused=False)


def slurm_job_state(job_id: str) -> tuple[str | None, str | None]:
    """(state, exit code as 'code:signal' when accounting knows it). state is None when Slurm could not be asked
    (ask again later) and 'UNKNOWN' when neither squeue nor sacct knows the job."""
    q = _run(["squeue", "-j", job_id, "-h", "-o", "%T"])
    if q.returncode == 127:
        raise _missing("squeue", "slurm", "a Slurm login node")
    state = q.stdout.split()[0] if q.returncode == 0 and q.stdout.strip() else None
    if state in SLURM_ACTIVE:
        return state, None
    if state is None and q.returncode != 0 and "invalid job id" not in _output(q).lower():
        return None, None  # the controller did not answer: not a verdict on the job
    a = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"])  # accounting may be absent
    rows = [r.split("|") for r in a.stdout.splitlines() if "|" in r] if a.returncode == 0 else []
    if rows:
        acct_state = rows[-1][0].split()[0] if rows[-1][0].strip() else "UNKNOWN"  # "CANCELLED by 1000"
        return state or acct_state, rows[-1][1].strip() or None
    # no accounting: the controller still holds a finished job for MinJobAge (300 s by default)
    ctl_state, code = _scontrol_job(job_id)
    return state or ctl_state or "UNKNOWN", code


def _scontrol_job(job_id: str) -> tuple[str | None, str | None]:
    """(JobState, ExitCode) from `scontrol show job -o`, (None, None) when the controller does not know the job."""
    proc = _run(["scontrol", "show", "job", "-o", job_id])
    if proc.returncode != 0:
        return None, None
    fields = dict(f.split("=", 1) for f in proc.stdout.split() if "=" in f)
    return fields.get("JobState"), fields.get("ExitCode")


def _slurm_reattach(rdir: Path) -> tuple[str, str] | None:
    """(job id, state) of the job recorded for this run when it is still queued or running."""
    record = rdir / SLURM_RECORD
    if not record.exists():
        return None
    job_id = str(json.loads(record.read_text())["job_id"])
    state, _ = slurm_job_state(job_id)
    return (job_id, state) if state in SLURM_ACTIVE else None


def submit_slurm(
    cfg: PipelineConfig,
    manifest: dict,
    echo: Callable[[str], None] = print,
    env: dict[str, str] | None = None,
    trainer: str = TRAINER,
) -> dict:
    """Train the run of `cfg` as a Slurm job (`train.slurm`): reuse a finished run, reattach to its job when one is
    still queued or running, else write `launch.sbatch` (as `difflm launch`) and submit it; wait, echo progress
    and return {'run_dir', 'checkpoint', 'reused'} as `launch_training`. The run directory must be on a
    filesystem the compute nodes share with this process. `trainer`: the module torchrun runs (`launch_training`)."""
    rdir = run_dir(cfg, manifest)
    if is_finished(cfg, rdir):
        echo(f"[train] reusing finished run {rdir}")
        return train_info(cfg, rdir, reused=True)
    s = cfg.train.slurm
    found = _slurm_reattach(rdir)
    if found:
        job_id, state = found
        echo(f"[slurm] job {job_id} of this run is still {state}: waiting for it instead of submitting another")
    else:
        resumed = prepare_attempt(rdir)
        script = write_launch_file(cfg, manifest, "slurm", env, trainer)
        sub = _run(sbatch_command(cfg, script, "--parsable"), cwd=ROOT)
        if sub.returncode == 127:
            raise _missing("sbatch", "slurm", "a Slurm login node")
        if sub.returncode != 0 or not sub.stdout.strip():
            raise ClusterError(
                f"sbatch did not take {script}: {_output(sub)}\nFix train.slurm.* (partition, time, "
                f"gpus_per_node, sbatch_args) and rerun; `difflm launch --target slurm` writes the same "
                f"script to try by hand"
            )
        job_id = sub.stdout.strip().splitlines()[-1].split(";")[0]
        (rdir / SLURM_RECORD).write_text(
            json.dumps({"job_id": job_id, "script": str(script), "submitted": time.time()})
        )
        echo(
            f"[slurm] submitted job {job_id} ({'resuming from iteration ' + str(resumed) if resumed else 'starting'})"
            f": {script}"
        )
    log = rdir / f"slurm-{job_id}.out"
    echo(f"[slurm] job log: {log}")
    follower, deadline = _Follower(log, from_end=bool(found)), _Deadline(s.wait_hours)
    shown, unanswered = None, 0
    try:
        while True:
            state, code = slurm_job_state(job_id)
            _echo_training_lines(follower, echo)
            unanswered = unanswered + 1 if state is None else 0
            if state is not None and state != shown:
                echo(
                    f"[slurm] job {job_id}: {state}"
                    + (f" (held: scontrol release {job_id})" if state in ("REQUEUE_HOLD", "SPECIAL_EXIT") else "")
                )
                shown = state
            if state is not None and state not in SLURM_ACTIVE:
                break
            if unanswered * s.poll_seconds > 3600:
                raise ClusterError(
                    f"Slurm has not answered squeue about job {job_id} for an hour: check the "
                    f"controller; the job may still run (log: {log}); a rerun reattaches to it"
                )
            if deadline.passed():
                raise ClusterError(
                    f"Slurm job {job_id} is still {shown} after train.slurm.wait_hours="
                    f"{s.wait_hours}; it keeps running (log: {log}). Rerun to wait again (reattaches) "
                    f"or stop it: scancel {job_id}"
                )
            time.sleep(s.poll_seconds)
    except BaseException as err:
        _left_running(err, echo, f"[slurm] stopped waiting; job {job_id}", f"scancel {job_id}")
        raise
    _echo_training_lines(follower, echo)
    if is_finished(cfg, rdir):
        return _finished(cfg, rdir, echo, f"[slurm] job {job_id}")
    raise_for_markers(rdir, code, log)
    raise TrainingError(
        f"Slurm job {job_id} ended {state}" + (f" (exit {code})" if code else "") + f" {_not_finished(cfg, rdir)}; "
        f"log: {log}. Rerunning submits a new job that resumes from the latest checkpoint (sacct -j {job_id} for "
        f"the scheduler's side). Last lines of the log:\n" + "\n".join(follower.errors or follower.tail)
    )


# ---- Kubernetes ---------------------------------------------------------------------------------------------


def _kubectl(cfg: PipelineConfig, *args: str) -> subprocess.CompletedProcess:
    ns = cfg.train.kubernetes.namespace
    proc = _run(["kubectl", *(["--namespace", ns] if ns else []), *args])
    if proc.returncode == 127:
        raise _missing("kubectl", "kubernetes", "a machine (or in-cluster pod) whose kubectl reaches the cluster")
    return proc


def get_pytorchjob(cfg: PipelineConfig, name: str) -> dict | None:
    """The PyTorchJob as Kubernetes returns it, None when there is none; raises when the API does not answer."""
    proc = _kubectl(cfg, "get", "pytorchjob", name, "-o", "json")
    if proc.returncode == 0:
        return json.loads(proc.stdout)
    if "notfound" in _output(proc).lower().replace(" ", ""):
        return None
    raise ClusterError(f"kubectl get pytorchjob {name} failed: {_output(proc)}")


def pytorchjob_phase(job: dict) -> str:
    """Succeeded or Failed once over, else its newest true condition (Created, Running, Restarting, Suspended),
    else Pending."""
    true = [c for c in (job.get("status") or {}).get("conditions") or [] if str(c.get("status")) == "True"]
    for final in ("Succeeded", "Failed"):
        if any(c.get("type") == final for c in true):
            return final
    return true[-1]["type"] if true else "Pending"


def _reason(job: dict, phase: str) -> str:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == phase and (c.get("reason") or c.get("message")):
            return f" ({': '.join(x for x in (c.get('reason'), c.get('message')) if x)})"
    return ""


def _job_run_dir(job: dict) -> str | None:
    for spec in (job.get("spec") or {}).get("pytorchReplicaSpecs", {}).values():
        command = spec["template"]["spec"]["containers"][0].get("command") or []
        if "--run-dir" in command:
            return command[command.index("--run-dir") + 1]
    return None


def _save_pod_logs(cfg: PipelineConfig, name: str, rdir: Path) -> tuple[Path, str]:
    """The job's pod logs (all replicas) appended to <run>/k8s-<name>.log; (that file, the last lines)."""
    proc = _kubectl(
        cfg, "logs", "-l", f"training.kubeflow.org/job-name={name}", "--prefix", "--tail=2000", "--all-containers"
    )
    path = rdir / f"k8s-{name}.log"
    with path.open("a") as fh:
        fh.write(proc.stdout if proc.returncode == 0 else f"kubectl logs failed: {_output(proc)}\n")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return path, "\n".join((errors or lines)[-15:])


def submit_kubernetes(
    cfg: PipelineConfig, manifest: dict, echo: Callable[[str], None] = print, env: dict[str, str] | None = None
) -> dict:
    """Train the run of `cfg` as a Kubeflow PyTorchJob (`train.kubernetes`): reuse a finished run, reattach to its
    job when one is still active, else (deleting a finished job of the same name) write `pytorchjob.yaml` (as
    `difflm launch --target k8s`) and `kubectl apply` it; wait, echo progress and return {'run_dir',
    'checkpoint', 'reused'} as `launch_training`. The pods must mount the workdir at the same path."""
    rdir = run_dir(cfg, manifest)
    if is_finished(cfg, rdir):
        echo(f"[train] reusing finished run {rdir}")
        return train_info(cfg, rdir, reused=True)
    k = cfg.train.kubernetes
    problem = mount_problem(cfg, rdir)
    if problem:
        raise ClusterError(f"train.launcher=kubernetes: {problem}")
    name = pytorchjob_name(rdir)
    described = f"kubectl{' --namespace ' + k.namespace if k.namespace else ''} describe pytorchjob {name}"
    job = get_pytorchjob(cfg, name)
    attached = False
    if job is not None:
        theirs, phase = _job_run_dir(job), pytorchjob_phase(job)
        if theirs != str(rdir):
            raise ClusterError(
                f"a PyTorchJob {name} exists for another run directory ({theirs}): delete it "
                f"(kubectl delete pytorchjob {name}) or set train.kubernetes.namespace"
            )
        if phase in K8S_FINAL:
            echo(f"[k8s] deleting the earlier PyTorchJob {name} ({phase}) to submit a new one")
            gone = _kubectl(cfg, "delete", "pytorchjob", name, "--wait=true")
            if gone.returncode != 0 and get_pytorchjob(cfg, name) is not None:
                raise ClusterError(f"kubectl delete pytorchjob {name} failed: {_output(gone)}")
        else:
            attached = True
            echo(f"[k8s] PyTorchJob {name} of this run is still {phase}: waiting for it instead of submitting again")
    if not attached:
        resumed = prepare_attempt(rdir)
        path = write_launch_file(cfg, manifest, "kubernetes", env)
        applied = _kubectl(cfg, "apply", "-f", str(path))
        if applied.returncode != 0:
            raise ClusterError(
                f"kubectl apply -f {path} failed: {_output(applied)}\nIs the Kubeflow training "
                f"operator installed (the PyTorchJob kind) and train.kubernetes.* right?"
            )
        echo(
            f"[k8s] submitted PyTorchJob {name} ({'resuming from iteration ' + str(resumed) if resumed else 'starting'})"
            f": {path}"
        )
    follower = _Follower(RunDir(rdir).metrics_file, from_end=attached)
    deadline, started = _Deadline(k.wait_hours), _Deadline(k.start_timeout_minutes and k.start_timeout_minutes / 60)
    shown, running = None, False
    try:
        while True:
            job = get_pytorchjob(cfg, name)
            phase = pytorchjob_phase(job) if job is not None else "Deleted"
            _echo_metrics(follower, echo)
            if phase != shown:
                echo(f"[k8s] PyTorchJob {name}: {phase}")
                shown = phase
            if phase in K8S_FINAL or phase == "Deleted":
                break
            running = running or phase in ("Running", "Restarting")
            if not running and started.passed():
                raise ClusterError(
                    f"PyTorchJob {name} is not Running after train.kubernetes.start_timeout_minutes="
                    f"{k.start_timeout_minutes} (still {phase}): see why its pods wait (kubectl describe "
                    f"pods -l training.kubeflow.org/job-name={name}: scheduling, image pull, claim "
                    f"{k.pvc}). The job is left in place; a rerun reattaches, or delete it"
                )
            if deadline.passed():
                raise ClusterError(
                    f"PyTorchJob {name} is still {phase} after train.kubernetes.wait_hours="
                    f"{k.wait_hours}; it keeps running. Rerun to wait again (reattaches) or delete it: "
                    f"kubectl delete pytorchjob {name}"
                )
            time.sleep(k.poll_seconds)
    except BaseException as err:
        _left_running(err, echo, f"[k8s] stopped waiting; PyTorchJob {name}", f"kubectl delete pytorchjob {name}")
        raise
    _echo_metrics(follower, echo)
    if is_finished(cfg, rdir):
        return _finished(cfg, rdir, echo, f"[k8s] PyTorchJob {name}")
    log, last = _save_pod_logs(cfg, name, rdir)
    raise_for_markers(rdir, f"PyTorchJob {phase}", log)
    raise TrainingError(
        f"PyTorchJob {name} ended {phase}{_reason(job, phase) if job else ' (deleted)'} {_not_finished(cfg, rdir)}; "
        f"pod logs: {log}; details: {described}. Rerunning deletes this job and submits a new one that resumes "
        f"from the latest checkpoint. Last lines of the logs:\n{last}"
    )
