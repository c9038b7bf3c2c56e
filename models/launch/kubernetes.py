"""Kubernetes: a Kubeflow PyTorchJob for the trainer entry point (1 master + workers, `torchrun` in each pod; the
config and data manifest travel as files in the run directory on a shared claim), and `submit_kubernetes`, which
applies it (or reattaches to the run's job), waits (`difflm.models.launch.jobs.wait_for_job`) and returns the run's
`TrainResult` as a local launch does."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import yaml

from difflm.config import PipelineConfig
from difflm.manifest import DataManifest
from difflm.models.launch.jobs import (
    ClusterError,
    Deadline,
    Follower,
    echo_metrics,
    missing,
    not_finished,
    output,
    run_command,
    wait_for_job,
)
from difflm.models.launch.torchrun import (
    TrainingError,
    is_finished,
    one_launcher,
    prepare_attempt,
    raise_for_markers,
    trainer_args,
    write_run_inputs,
)
from difflm.rundir import RunDir, TrainResult, Workdir

K8S_FINAL = {"Succeeded", "Failed"}
LAUNCH_FILE = "pytorchjob.yaml"


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
    """A Kubeflow PyTorchJob: 1 master + (nnodes - 1) workers, `train.launch.nproc_per_node` ranks per pod.
    image/pvc/mount default to `train.launch.kubernetes.*`."""
    t, k = cfg.train, cfg.train.launch.kubernetes
    gpus = t.launch.nproc_per_node if k.gpus_per_pod is None else k.gpus_per_pod
    container = {
        "name": "pytorch",
        "image": image or k.image,
        "command": [
            "torchrun",
            "--nnodes",
            str(t.launch.nnodes),
            "--nproc_per_node",
            str(t.launch.nproc_per_node),
            *trainer_args(config, manifest, run_dir),
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
    if t.launch.nnodes > 1:
        replicas["Worker"] = {"replicas": t.launch.nnodes - 1, "restartPolicy": "OnFailure", "template": pod}
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": pytorchjob_name(run_dir), **({"namespace": k.namespace} if k.namespace else {})},
        "spec": {"pytorchReplicaSpecs": replicas},
    }
    return yaml.safe_dump(job, sort_keys=False)


def write_kubernetes_file(cfg: PipelineConfig, manifest: DataManifest, env: dict[str, str] | None = None) -> Path:
    """Write the run's inputs and its `pytorchjob.yaml`; returns it (what `difflm launch --target k8s` writes and
    `submit_kubernetes` applies)."""
    run = Workdir.of(cfg).run_for(cfg, manifest)
    config, manifest_path = write_run_inputs(cfg, manifest, run)
    out = run.path / LAUNCH_FILE
    out.write_text(k8s_pytorchjob(cfg, config, manifest_path, run.path, env=env))
    return out


def mount_problem(cfg: PipelineConfig, rdir: Path) -> str | None:
    """Why the pods would not see `rdir` at the same path (None: they would)."""
    mount = Path(cfg.train.launch.kubernetes.mount)
    if mount in rdir.parents:
        return None
    return (
        f"the run directory {rdir} is not under train.launch.kubernetes.mount={mount}, where the pods mount the "
        f"claim {cfg.train.launch.kubernetes.pvc}: set workdir under it (e.g. workdir={mount / 'difflm'}), with the "
        f"claim mounted at that path wherever the pipeline runs"
    )


def _kubectl(cfg: PipelineConfig, *args: str) -> subprocess.CompletedProcess:
    ns = cfg.train.launch.kubernetes.namespace
    proc = run_command(["kubectl", *(["--namespace", ns] if ns else []), *args])
    if proc.returncode == 127:
        raise missing("kubectl", "kubernetes", "a machine (or in-cluster pod) whose kubectl reaches the cluster")
    return proc


def get_pytorchjob(cfg: PipelineConfig, name: str) -> dict | None:
    """The PyTorchJob as Kubernetes returns it, None when there is none; raises when the API does not answer."""
    proc = _kubectl(cfg, "get", "pytorchjob", name, "-o", "json")
    if proc.returncode == 0:
        return json.loads(proc.stdout)
    if "notfound" in output(proc).lower().replace(" ", ""):
        return None
    raise ClusterError(f"kubectl get pytorchjob {name} failed: {output(proc)}")


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


def _save_pod_logs(cfg: PipelineConfig, name: str, run: RunDir) -> tuple[Path, str]:
    """The job's pod logs (all replicas) appended to <run>/k8s-<name>.log; (that file, the last lines)."""
    proc = _kubectl(
        cfg, "logs", "-l", f"training.kubeflow.org/job-name={name}", "--prefix", "--tail=2000", "--all-containers"
    )
    path = run.path / f"k8s-{name}.log"
    with path.open("a") as fh:
        fh.write(proc.stdout if proc.returncode == 0 else f"kubectl logs failed: {output(proc)}\n")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return path, "\n".join((errors or lines)[-15:])


class PyTorchJob:
    """An applied PyTorchJob as `wait_for_job` follows it: `kubectl get` for its phase, the run's metrics.jsonl
    for progress (the pods' logs are not on shared storage)."""

    prefix = "[k8s]"

    def __init__(self, cfg: PipelineConfig, name: str, run: RunDir, reattached: bool):
        self.cfg, self.name, self.settings = cfg, name, cfg.train.launch.kubernetes
        self.label, self.stop = f"PyTorchJob {name}", f"kubectl delete pytorchjob {name}"
        wait = cfg.train.launch.wait
        self.poll_seconds, self.wait_hours = wait.poll_seconds, wait.wait_hours
        minutes = self.settings.start_timeout_minutes
        self.started = Deadline(minutes and minutes / 60)
        self.follower = Follower(run.metrics_file, from_end=reattached)
        self.job: dict | None = None
        self.running = False

    def poll(self) -> str:
        self.job = get_pytorchjob(self.cfg, self.name)
        phase = pytorchjob_phase(self.job) if self.job is not None else "Deleted"
        self.running = self.running or phase in ("Running", "Restarting")
        return phase

    def is_over(self, state: str) -> bool:
        return state in K8S_FINAL or state == "Deleted"

    def describe(self, state: str) -> str:
        return f"[k8s] PyTorchJob {self.name}: {state}"

    def progress(self, echo: Callable[[str], None]) -> None:
        echo_metrics(self.follower, echo)

    def check(self, state: str | None) -> None:
        k, name = self.settings, self.name
        if not self.running and self.started.passed():
            raise ClusterError(
                f"PyTorchJob {name} is not Running after train.launch.kubernetes.start_timeout_minutes="
                f"{k.start_timeout_minutes} (still {state}): see why its pods wait (kubectl describe "
                f"pods -l training.kubeflow.org/job-name={name}: scheduling, image pull, claim "
                f"{k.pvc}). The job is left in place; a rerun reattaches, or delete it"
            )

    def still_running(self, state: str | None) -> ClusterError:
        return ClusterError(
            f"PyTorchJob {self.name} is still {state} after train.launch.wait.wait_hours="
            f"{self.wait_hours}; it keeps running. Rerun to wait again (reattaches) or delete it: "
            f"kubectl delete pytorchjob {self.name}"
        )

    def failure(self, cfg: PipelineConfig, run: RunDir, state: str | None) -> Exception:
        name, ns = self.name, self.settings.namespace
        described = f"kubectl{' --namespace ' + ns if ns else ''} describe pytorchjob {name}"
        log, last = _save_pod_logs(cfg, name, run)
        raise_for_markers(run, f"PyTorchJob {state}", log)
        why = _reason(self.job, state) if self.job else " (deleted)"
        return TrainingError(
            f"PyTorchJob {name} ended {state}{why} {not_finished(cfg, run)}; pod logs: {log}; details: "
            f"{described}. Rerunning deletes this job and submits a new one that resumes from the latest "
            f"checkpoint. Last lines of the logs:\n{last}"
        )


def submit_kubernetes(
    cfg: PipelineConfig, manifest: DataManifest, echo: Callable[[str], None] = print, env: dict[str, str] | None = None
) -> TrainResult:
    """Train the run of `cfg` as a Kubeflow PyTorchJob (`train.launch.kubernetes`): reuse a finished run, reattach to its
    job when one is still active, else (deleting a finished job of the same name) write `pytorchjob.yaml` (as
    `difflm launch --target k8s`) and `kubectl apply` it; wait, echo progress and return the run's result as
    `launch_training`. The pods must mount the workdir at the same path."""
    run = Workdir.of(cfg).run_for(cfg, manifest)
    with one_launcher(cfg, run, echo):
        return _apply_and_wait(cfg, manifest, run, echo, env)


def _apply_and_wait(cfg: PipelineConfig, manifest: DataManifest, run: RunDir, echo, env) -> TrainResult:
    if is_finished(cfg, run):
        echo(f"[train] reusing finished run {run.path}")
        return TrainResult.of(cfg, run, reused=True)
    problem = mount_problem(cfg, run.path)
    if problem:
        raise ClusterError(f"train.launch.launcher=kubernetes: {problem}")
    name = pytorchjob_name(run.path)
    attached = _reattach(cfg, name, run, echo)
    if not attached:
        resumed = prepare_attempt(run)
        path = write_kubernetes_file(cfg, manifest, env)
        applied = _kubectl(cfg, "apply", "-f", str(path))
        if applied.returncode != 0:
            raise ClusterError(
                f"kubectl apply -f {path} failed: {output(applied)}\nIs the Kubeflow training "
                f"operator installed (the PyTorchJob kind) and train.launch.kubernetes.* right?"
            )
        echo(
            f"[k8s] submitted PyTorchJob {name} ({'resuming from iteration ' + str(resumed) if resumed else 'starting'})"
            f": {path}"
        )
    return wait_for_job(cfg, run, PyTorchJob(cfg, name, run, reattached=attached), echo)


def _reattach(cfg: PipelineConfig, name: str, run: RunDir, echo: Callable[[str], None]) -> bool:
    """Whether the run's job is still active (waited for, not submitted again); a finished one is deleted."""
    job = get_pytorchjob(cfg, name)
    if job is None:
        return False
    theirs, phase = _job_run_dir(job), pytorchjob_phase(job)
    if theirs != str(run.path):
        raise ClusterError(
            f"a PyTorchJob {name} exists for another run directory ({theirs}): delete it "
            f"(kubectl delete pytorchjob {name}) or set train.launch.kubernetes.namespace"
        )
    if phase not in K8S_FINAL:
        echo(f"[k8s] PyTorchJob {name} of this run is still {phase}: waiting for it instead of submitting again")
        return True
    echo(f"[k8s] deleting the earlier PyTorchJob {name} ({phase}) to submit a new one")
    gone = _kubectl(cfg, "delete", "pytorchjob", name, "--wait=true")
    if gone.returncode != 0 and get_pytorchjob(cfg, name) is not None:
        raise ClusterError(f"kubectl delete pytorchjob {name} failed: {output(gone)}")
    return False
