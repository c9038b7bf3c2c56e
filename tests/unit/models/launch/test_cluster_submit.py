"""`train.launch.launcher=kubernetes`: the train task writes the launch file of `difflm launch`, applies it, waits and
returns what a local launch returns. No Kubernetes cluster can run here: a fake `kubectl` (put first on PATH) really
runs the job as the PyTorchJob operator would: the master replica's container command with the operator's
variables. Slurm is tested on a real cluster (tests/integration/test_slurm.py); `difflm launch` and the deployments are here."""

from __future__ import annotations

import json
import os
import stat
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from helpers import SHORT_RUN as SHORT
from helpers import manifest_record, tiny_config

from difflm.config import load_config
from difflm.flows.cli import main
from difflm.models.launch.cluster import (
    ClusterError,
    mount_problem,
    pytorchjob_name,
    submit_kubernetes,
    write_launch_file,
)
from difflm.models.launch.torchrun import TrainingError, launch_training, run_dir
from difflm.tasks.stages import train_task

pytestmark = pytest.mark.integration  # the fake kubectl runs as Python processes

ROOT = Path(__file__).resolve().parents[4]

FAKE_KUBECTL = r"""
import json, os, signal, socket, subprocess, sys
from pathlib import Path

import yaml

STATE = Path(os.environ["FAKE_CLUSTER_DIR"])
args = sys.argv[1:]
if args[:1] == ["--namespace"]:
    args = args[2:]


def job_path(name):
    return STATE / f"pytorchjob-{name}.json"


def update(name, **kw):
    path = job_path(name)
    rec = {**json.loads(path.read_text()), **kw}
    path.with_suffix(".tmp").write_text(json.dumps(rec))
    path.with_suffix(".tmp").replace(path)


def condition(kind, reason="", message=""):
    return {"type": kind, "status": "True", "reason": reason, "message": message}


if args[:1] == ["--run-master"]:  # the operator starts the master pod: its container command, its variables
    name = args[1]
    rec = json.loads(job_path(name).read_text())
    specs = rec["job"]["spec"]["pytorchReplicaSpecs"]
    container = specs["Master"]["template"]["spec"]["containers"][0]
    nnodes = sum(s["replicas"] for s in specs.values())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, **{e["name"]: e["value"] for e in container.get("env", [])},
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # torchrun is on the image's PATH
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(nnodes), "RANK": "0",
           "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port, "PET_NNODES": str(nnodes), "PET_NODE_RANK": "0",
           "PET_NPROC_PER_NODE": container["command"][container["command"].index("--nproc_per_node") + 1]}
    log = STATE / f"pod-{name}-master-0.log"
    with log.open("a") as fh:
        if os.environ.get("FAKE_K8S_POD_FAILS"):  # the pod fails until the operator's backoff limit
            fh.write("RuntimeError: CUDA error: an illegal memory access was encountered\n")
            update(name, conditions=rec["conditions"] + [condition("Failed", "PyTorchJobFailed",
                                                                   f"PyTorchJob {name} has failed")])
            sys.exit(0)
        update(name, conditions=rec["conditions"] + [condition("Running", "PyTorchJobRunning")])
        code = subprocess.call(container["command"], env=env, cwd=os.environ["FAKE_IMAGE_WORKDIR"], stdout=fh,
                               stderr=subprocess.STDOUT)
    rec = json.loads(job_path(name).read_text())
    final = condition("Succeeded", "PyTorchJobSucceeded") if code == 0 else condition(
        "Failed", "PyTorchJobFailed", f"master-0 exited with code {code}")
    update(name, conditions=rec["conditions"] + [final])
    sys.exit(0)

with (STATE / "calls.jsonl").open("a") as fh:
    fh.write(json.dumps(["kubectl", *args]) + "\n")
verb = args[0]
if verb == "apply":
    job = yaml.safe_load(Path(args[args.index("-f") + 1]).read_text())
    name = job["metadata"]["name"]
    if job_path(name).exists():
        print(f"pytorchjob.kubeflow.org/{name} unchanged")
        sys.exit(0)
    job_path(name).write_text(json.dumps({"job": job, "conditions": [condition("Created", "PyTorchJobCreated")]}))
    image = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"]
    if "unpullable" not in image:  # else the pod stays in ImagePullBackOff: the job never runs
        pid = subprocess.Popen([sys.executable, __file__, "--run-master", name], start_new_session=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid
        update(name, pid=pid)
    print(f"pytorchjob.kubeflow.org/{name} created")
elif verb == "get":
    name = args[2]
    if not job_path(name).exists():
        print(f'Error from server (NotFound): pytorchjobs.kubeflow.org "{name}" not found', file=sys.stderr)
        sys.exit(1)
    rec = json.loads(job_path(name).read_text())
    print(json.dumps({**rec["job"], "status": {"conditions": rec["conditions"]}}))
elif verb == "delete":
    name = args[2]
    if job_path(name).exists():
        pid = json.loads(job_path(name).read_text()).get("pid")
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        job_path(name).unlink()
    print(f'pytorchjob.kubeflow.org "{name}" deleted')
elif verb == "logs":
    name = args[args.index("-l") + 1].split("=", 1)[1]
    log = STATE / f"pod-{name}-master-0.log"
    for line in (log.read_text().splitlines() if log.exists() else []):
        print(f"[pod/{name}-master-0/pytorch] {line}")
else:
    print(f"fake kubectl: {verb} not supported", file=sys.stderr)
    sys.exit(1)
"""


@pytest.fixture
def cluster(tmp_path, monkeypatch) -> Path:
    """A fake kubectl first on PATH; its state (jobs, calls made) in the returned folder."""
    bin_dir, state = tmp_path / "bin", tmp_path / "cluster"
    bin_dir.mkdir()
    state.mkdir()
    path = bin_dir / "kubectl"
    path.write_text(f"#!{sys.executable}\n{FAKE_KUBECTL}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CLUSTER_DIR", str(state))
    monkeypatch.setenv("FAKE_IMAGE_WORKDIR", str(ROOT))  # the image's WORKDIR: the project
    return state


def _calls(state: Path, prog: str) -> list[list[str]]:
    path = state / "calls.jsonl"
    calls = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [c for c in calls if c[0] == prog]


def _untried_train_task():
    return train_task.with_options(retries=0)


@pytest.mark.slow
def test_kubernetes_launcher_trains_the_same_run_as_a_local_launch(
    tmp_path, cluster, tiny_manifest, prefect_harness, monkeypatch
):
    work = tmp_path / "pvc" / "difflm"  # the claim is mounted at tmp_path/pvc in the worker and the pods
    k8s = [
        *SHORT,
        "train.launch.launcher=kubernetes",
        f"train.launch.kubernetes.mount={tmp_path / 'pvc'}",
        "train.launch.kubernetes.gpus_per_pod=0",
        "train.launch.wait.poll_seconds=0.3",
    ]
    cfg, local = tiny_config(work, *k8s), tiny_config(work, *SHORT)
    rdir = run_dir(local, tiny_manifest)
    name = pytorchjob_name(rdir)

    # the job fails (its pod keeps crashing): the error names the job, the saved pod logs and what to do
    monkeypatch.setenv("FAKE_K8S_POD_FAILS", "1")
    with pytest.raises(TrainingError) as err:
        _untried_train_task()(cfg, tiny_manifest, {})
    msg = str(err.value)
    log = rdir / f"k8s-{name}.log"
    assert f"PyTorchJob {name} ended Failed (PyTorchJobFailed: PyTorchJob {name} has failed) without" in msg
    assert f"pod logs: {log}" in msg
    assert "illegal memory access" in msg and "illegal memory access" in log.read_text()
    assert f"describe pytorchjob {name}" in msg and "resumes" in msg

    # rerun: the failed job is deleted and a new one trains the run of a local launch
    monkeypatch.delenv("FAKE_K8S_POD_FAILS")
    info = train_task(cfg, tiny_manifest, {"DIFFLM_TEST_ENV": "into the pod"})
    assert info.run.path == rdir and not info.reused and info.checkpoint.name == "iter_0000004"
    verbs = [c[1] for c in _calls(cluster, "kubectl") if c[1] in ("apply", "delete")]
    assert verbs == ["apply", "delete", "apply"]
    job = yaml.safe_load((rdir / "pytorchjob.yaml").read_text())
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert {"name": "DIFFLM_TEST_ENV", "value": "into the pod"} in container["env"] and "resources" not in container
    assert container["command"][container["command"].index("--run-dir") + 1] == str(rdir)
    assert "[train] mode=difflm-noshift" in (tmp_path / "cluster" / f"pod-{name}-master-0.log").read_text()

    assert launch_training(local, tiny_manifest, echo=lambda _: None) == replace(info, reused=True)
    assert train_task(cfg, tiny_manifest, {}) == replace(info, reused=True)
    assert len([c for c in _calls(cluster, "kubectl") if c[1] == "apply"]) == 2


# ---- without training: problems, timeouts ------------------------------------------

MANIFEST = manifest_record("0123456789abcdef", "/nowhere")  # a run that is never trained here


def test_kubernetes_problems_are_cluster_errors(tmp_path, cluster):
    mount = tmp_path / "pvc"
    outside = tiny_config(
        tmp_path / "elsewhere", "train.launch.launcher=kubernetes", f"train.launch.kubernetes.mount={mount}"
    )
    with pytest.raises(ClusterError, match=r"not under train.launch.kubernetes.mount=.*set workdir under it"):
        submit_kubernetes(outside, MANIFEST, echo=lambda _: None)
    assert not _calls(cluster, "kubectl")

    # a job whose pods never start (the image cannot be pulled): a clear error after start_timeout_minutes
    cfg = tiny_config(
        mount / "difflm",
        "train.launch.launcher=kubernetes",
        f"train.launch.kubernetes.mount={mount}",
        "train.launch.kubernetes.image=registry.example/unpullable:1",
        "train.launch.wait.poll_seconds=0.1",
        "train.launch.kubernetes.start_timeout_minutes=0.01",
    )
    name = pytorchjob_name(run_dir(cfg, MANIFEST))
    with pytest.raises(
        ClusterError,
        match=rf"PyTorchJob {name} is not Running after .*start_timeout_minutes=0.01 "
        rf"\(still Created\): .*kubectl describe pods",
    ):
        submit_kubernetes(cfg, MANIFEST, echo=lambda _: None)

    # a job of that name that trains another run directory is not taken for this run's
    other = json.loads((cluster / f"pytorchjob-{name}.json").read_text())
    command = other["job"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    command[command.index("--run-dir") + 1] = "/somewhere/else"
    (cluster / f"pytorchjob-{name}.json").write_text(json.dumps(other))
    with pytest.raises(ClusterError, match=f"a PyTorchJob {name} exists for another run directory"):
        submit_kubernetes(cfg, MANIFEST, echo=lambda _: None)


def test_launch_cli_writes_what_the_launchers_submit(session_dir, tiny_manifest, capsys):
    """`difflm launch` options override train.launch.slurm.* / train.launch.kubernetes.*; the file is the one a launcher submits."""
    work = session_dir / "shared"  # where tiny_manifest's data is: reused
    overrides = [f"workdir={work}", "train.train_iters=7", "train.schedule.warmup_iters=1"]
    assert main(["launch", "--preset", "test-tiny", *overrides, "--partition", "gpu", "--time", "01:00:00"]) == 0
    cfg = tiny_config(work, *overrides[1:], "train.launch.slurm.partition=gpu", "train.launch.slurm.time=01:00:00")
    rdir = run_dir(cfg, tiny_manifest)
    written = (rdir / "launch.sbatch").read_text()
    submit = f"submit: sbatch --time=01:00:00 --partition=gpu {rdir / 'launch.sbatch'}\n"
    assert submit in capsys.readouterr().out and "--partition" not in written  # sbatch arguments, not #SBATCH lines
    assert written == write_launch_file(cfg, tiny_manifest, "slurm").read_text()
    assert main(["launch", "--preset", "test-tiny", *overrides, "--target", "k8s", "--image", "img:2"]) == 0
    assert (
        "is not under train.launch.kubernetes.mount=/data" in capsys.readouterr().err
    )  # a warning, the file is written
    job = yaml.safe_load((rdir / "pytorchjob.yaml").read_text())
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"] == "img:2"


def test_cluster_deployments_resolve_to_their_launchers():
    """The prefect.yaml entries pretrain-difflm/slurm and /kubernetes give valid configs for their launcher."""
    entries = {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    for name in ("slurm", "kubernetes"):
        params = entries[name]["parameters"]
        cfg = load_config(params["preset"], params["overrides"])
        assert cfg.train.launch.launcher == name and Path(cfg.workdir).is_absolute()
        # the launcher does not change the run: the same run directory as the local deployment's config
        assert cfg.stage_hash("train") == load_config(params["preset"]).stage_hash("train")
    k8s = load_config(entries["kubernetes"]["parameters"]["preset"], entries["kubernetes"]["parameters"]["overrides"])
    assert mount_problem(k8s, Path(k8s.workdir) / "runs" / "r") is None
