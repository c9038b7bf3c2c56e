"""Where jobs run: the Slurm sections (data prep and training), the Kubernetes section and the job wait."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from difflm.config.base import OPERATIONAL, _Section, deprecated

# What may reach an sbatch script. Every value lands in a `#SBATCH --key=value` line, so a newline would start
# a shell line and whitespace would end the option: one token of these characters, validated here (a config
# error names the field) and checked again where the script is written (models/launch/cluster.py).
SBATCH_VALUE = re.compile(r"[\w.:,=@+/%&|!*\[\]()^-]*")
SBATCH_KEY = re.compile(r"[a-z][a-z0-9-]*")
PARTITION = re.compile(r"[\w.,-]+")
# Slurm's --time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds; or UNLIMITED / INFINITE
SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)

_NAME = re.compile(r"[\w.-]+")
_COUNT = re.compile(r"\d+")
_GPUS = re.compile(r"([\w.-]+:)?\d+(,([\w.-]+:)?\d+)*")  # 4, a100:4, a100:2,v100:1
_MEM = re.compile(r"\d+[KMGT]?", re.IGNORECASE)
_MAIL_TYPE = r"NONE|BEGIN|END|FAIL|REQUEUE|ALL|INVALID_DEPEND|STAGE_OUT|TIME_LIMIT(_50|_80|_90)?|ARRAY_TASKS"
# The sbatch options `sbatch_args` may set, each with the shape of its value. Only scheduling: where and when the
# job runs and on what. Options that change what the job runs, its environment or where it writes (export, wrap,
# chdir, output, error, input, get-user-env, container, ...) are refused: a deployment parameter reaches them.
SBATCH_OPTIONS: dict[str, re.Pattern[str]] = {
    "account": _NAME,
    "partition": PARTITION,
    "qos": _NAME,
    "reservation": re.compile(r"[\w.,-]+"),
    "wckey": _NAME,
    "constraint": re.compile(r"[\w.:,&|!*\[\]()-]+"),
    "licenses": re.compile(r"[\w.:,@-]+"),
    "gres": re.compile(r"[\w.:,-]+"),
    "gpus": _GPUS,
    "gpus-per-node": _GPUS,
    "gpus-per-task": _GPUS,
    "cpus-per-gpu": _COUNT,
    "nodes": re.compile(r"\d+(-\d+)?"),
    "ntasks": _COUNT,
    "ntasks-per-node": _COUNT,
    "cpus-per-task": _COUNT,
    "mem": _MEM,
    "mem-per-cpu": _MEM,
    "mem-per-gpu": _MEM,
    "time": SLURM_TIME,
    "time-min": SLURM_TIME,
    "exclusive": re.compile(r"|user|mcs|topo"),
    "begin": re.compile(r"[\w:+-]+"),  # now+1hour, 16:00, 2026-12-05T16:00:00
    "nice": re.compile(r"-?\d+"),
    "mail-type": re.compile(rf"({_MAIL_TYPE})(,({_MAIL_TYPE}))*", re.IGNORECASE),
    "mail-user": re.compile(r"[\w.+-]+(@[\w.-]+)?"),
}


def sbatch_option_problem(key: str, value: str) -> str | None:
    """Why `--key=value` may not be given to sbatch through `sbatch_args`, or None."""
    shape = SBATCH_OPTIONS.get(key)
    if shape is None:
        return (
            f"option {key!r} is not one sbatch_args may set (it could change what the job runs, its environment or "
            f"where it writes); allowed: {', '.join(sorted(SBATCH_OPTIONS))}"
        )
    if not shape.fullmatch(value):
        why = shell_safe_problem(value) or f"is not a value of --{key}"
        return f"{key}={value!r} {why}: give one token, e.g. {key}={_EXAMPLES.get(key, 'see man sbatch')}"
    return None


_EXAMPLES = {"account": "proj", "mem": "64G", "gpus": "a100:4", "nodes": "2", "time": "04:00:00", "exclusive": "''"}


def shell_safe_problem(value: str) -> str | None:
    """Why `value` may not go into a generated script unquoted (a control character or whitespace), or None."""
    bad = [c for c in value if c.isspace() or ord(c) < 32 or ord(c) == 127]
    if bad:
        return f"contains {bad[0]!r} (no whitespace or control characters: the value goes into a job script)"
    return None


class SlurmBase(_Section):
    """What every Slurm job of the pipeline is given: the data-prep jobs (`data.slurm`) and training
    (`train.launch.slurm`) add their own fields to these."""

    partition: str | None = Field(None, description="#SBATCH --partition (None: the cluster's default).")
    time: str = Field("04:00:00", description="#SBATCH --time: the time limit of one job.")
    sbatch_args: dict[str, str] = Field(
        default_factory=dict,
        description="More sbatch options, e.g. {account: proj, qos: high, cpus-per-task: '32', mem: 0}: scheduling "
        "options only (account, partition, qos, reservation, constraint, gres, gpus, nodes, cpus-per-task, mem, "
        "time, exclusive, begin, nice, mail-type, ...), each value of its option's shape.",
    )

    @field_validator("partition")
    @classmethod
    def _partition(cls, value: str | None) -> str | None:
        if value is not None and not PARTITION.fullmatch(value):
            raise ValueError(f"{value!r} is not a Slurm partition name (letters, digits, '_', '-', '.', ',')")
        return value

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, value: Any) -> Any:
        value = str(value) if isinstance(value, int) and not isinstance(value, bool) else value  # time=30: minutes
        if isinstance(value, str) and not SLURM_TIME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Slurm time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED"
            )
        return value

    @field_validator("sbatch_args", mode="before")
    @classmethod
    def _sbatch_args(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        out = {}
        for key, val in value.items():
            key, val = str(key).removeprefix("--").replace("_", "-"), "" if val is None else str(val)
            problem = sbatch_option_problem(key, val)
            if problem:
                raise ValueError(problem)
            out[key] = val
        return out


class SlurmConfig(SlurmBase):
    """How data prep runs on Slurm (`data.executor=slurm`, datatrove's SlurmPipelineExecutor): one job array
    of data.tasks CPU jobs."""

    cpus_per_task: int = Field(1, ge=1)
    mem_per_cpu_gb: int = Field(2, ge=1)


class SlurmLaunchConfig(SlurmBase):
    """How training is submitted to Slurm: `train.launch.launcher=slurm` and `difflm launch --target slurm`."""

    time: str = Field(
        "24:00:00",
        description="Time limit of one allocation; signal_seconds before it the job "
        "checkpoints and requeues itself, so a long run spans several allocations.",
    )
    signal_seconds: int = Field(
        120,
        ge=1,
        le=65535,
        description="#SBATCH --signal=B:USR1@N: how long before the time limit the job is told to checkpoint and "
        "requeue (Slurm checks time limits every 30 s and may signal up to 60 s earlier); leave the checkpoint "
        "time to save.",
    )
    gpus_per_node: int | None = Field(
        None,
        ge=0,
        description="#SBATCH --gpus-per-node (None: train.launch.nproc_per_node; 0: no GPU request, for CPU nodes).",
    )
    python: str | None = Field(
        None,
        description="Python on the compute nodes, with this project installed: an absolute path to an executable "
        "file on the filesystem the nodes share, checked when the job script is written (None: the interpreter "
        "that submits, which must then live there too).",
    )

    @field_validator("python")
    @classmethod
    def _python(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("/") or shell_safe_problem(value)):
            raise ValueError(f"{value!r} is not an absolute path to a python executable, e.g. /shared/venv/bin/python")
        return value


class KubernetesLaunchConfig(_Section):
    """How training is submitted to Kubernetes as a Kubeflow PyTorchJob: `train.launch.launcher=kubernetes` and
    `difflm launch --target k8s`."""

    image: str = Field("difflm-pipeline:latest", description="Container image with this project installed.")
    pvc: str = Field(
        "difflm-data", description="PersistentVolumeClaim holding the workdir (ReadWriteMany for several nodes)."
    )
    mount: str = Field(
        "/data",
        description="Where the pods mount the claim. The workdir must lie under it, and the worker that "
        "submits must see the claim at the same path (mount it there), so run directories have one name.",
    )
    namespace: str | None = Field(None, description="Namespace of the job (None: kubectl's current one).")
    gpus_per_pod: int | None = Field(
        None, ge=0, description="nvidia.com/gpu limit per pod (None: train.launch.nproc_per_node; 0: none, CPU pods)."
    )
    start_timeout_minutes: float | None = Field(
        60.0,
        gt=0.0,
        description="Fail when the job is not Running after this long (pods unschedulable, image "
        "not pulled); the job is left in place for `kubectl describe`. None: wait.",
    )


# Where the wait settings lived before `train.launch.wait`: each cluster section held its own copy.
WAIT_FIELDS = ("poll_seconds", "wait_hours")


class JobWaitConfig(_Section):
    """How a cluster launcher (Slurm or Kubernetes) waits for the job it submitted."""

    poll_seconds: float = Field(30.0, gt=0.0, description="How often the launcher asks the cluster about the job.")
    wait_hours: float | None = Field(
        None,
        gt=0.0,
        description="Stop waiting after this long (the job keeps running and a rerun reattaches "
        "to it); None: wait for as long as the job lasts, queueing and requeues included.",
    )


class LaunchConfig(_Section):
    """Who runs the trainer and on how many processes: `train.launch`."""

    launcher: Literal["local", "slurm", "kubernetes"] = Field(
        "local",
        json_schema_extra=OPERATIONAL,
        description="Who runs torchrun. local: a subprocess here (one node); slurm: an sbatch job "
        "(train.launch.slurm); kubernetes: a Kubeflow PyTorchJob (train.launch.kubernetes). Cluster launchers write "
        "the same launch file as `difflm launch`, submit it, wait for the job (train.launch.wait) and read the run "
        "directory, which must be on storage the nodes share. Operational: any launcher resumes any other's run.",
    )
    nproc_per_node: int = Field(1, ge=1, description="torchrun processes per node (GPUs per node; CPU: gloo ranks).")
    nnodes: int = Field(1, ge=1, description="Nodes (cluster launches: `difflm launch`).")
    slurm: SlurmLaunchConfig = Field(default_factory=SlurmLaunchConfig, json_schema_extra=OPERATIONAL)
    kubernetes: KubernetesLaunchConfig = Field(default_factory=KubernetesLaunchConfig, json_schema_extra=OPERATIONAL)
    wait: JobWaitConfig = Field(default_factory=JobWaitConfig, json_schema_extra=OPERATIONAL)

    @model_validator(mode="before")
    @classmethod
    def _wait_of_before(cls, data: Any) -> Any:
        """`slurm.poll_seconds`, `kubernetes.wait_hours`, ... (a copy per cluster before `wait`) still work for a
        release: moved into `wait`, the launcher in use's copy winning."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        moved: dict[str, Any] = {}
        order = sorted(("kubernetes", "slurm"), key=lambda s: s == data.get("launcher"))  # the one in use last
        for section in order:
            sub = data.get(section)
            if not isinstance(sub, dict) or not any(k in sub for k in WAIT_FIELDS):
                continue
            for key in [k for k in WAIT_FIELDS if k in sub]:
                deprecated(f"train.{section}.{key}", f"train.launch.wait.{key}")
                moved[key] = sub[key]
            data[section] = {k: v for k, v in sub.items() if k not in WAIT_FIELDS}
        if moved:
            wait = data.get("wait")
            wait = dict(wait) if isinstance(wait, dict) else {}
            data["wait"] = {**moved, **wait}
        return data
