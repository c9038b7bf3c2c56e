"""`train.launcher=slurm|kubernetes`: the train task writes the launch file of `difflm launch`, submits it, waits and
returns what a local launch returns. No cluster here: fake `sbatch`/`squeue`/`sacct`/`scontrol`/`srun` and `kubectl`
(scripts put first on PATH) really run the job, as a compute node or the PyTorchJob operator would: the sbatch script
under bash with the SLURM_* variables, the master replica's container command with the operator's variables."""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from helpers import tiny_config

from models.launch.cluster import (
    ClusterError,
    pytorchjob_name,
    slurm_script,
    submit_kubernetes,
    submit_slurm,
    write_launch_file,
)
from models.launch.torchrun import TrainingError, launch_training, run_dir

pytestmark = pytest.mark.integration  # fake sbatch/squeue/kubectl run as Python processes

ROOT = Path(__file__).resolve().parent.parent
SHORT = [
    "train.train_iters=4",
    "train.warmup_iters=1",
    "checkpoint.save_interval=2",
    "train.eval_interval=2",
    "train.log_interval=2",
    "train.eval_iters=1",
]

FAKE_SLURM = r"""
import json, os, random, socket, subprocess, sys, time
from pathlib import Path

STATE = Path(os.environ["FAKE_CLUSTER_DIR"])
prog, args = Path(sys.argv[0]).name, sys.argv[1:]


def job_path(job_id):
    return STATE / f"slurm-{job_id}.json"


def set_state(job_id, **kw):
    path = job_path(job_id)
    rec = {**json.loads(path.read_text()), **kw} if path.exists() else kw
    path.with_suffix(".tmp").write_text(json.dumps(rec))
    path.with_suffix(".tmp").replace(path)


if args[:1] == ["--run-job"]:  # the job on its "compute node": the batch script under bash
    job_id, script, out, chdir = args[1:5]
    node = socket.gethostname()
    env = {**os.environ, "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_NNODES": "1",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": node,
           "SLURMD_NODENAME": node, "SLURM_SUBMIT_DIR": os.getcwd(), "SLURM_CPUS_ON_NODE": str(os.cpu_count())}
    set_state(job_id, state="RUNNING")
    with open(out, "a") as fh:
        code = subprocess.call(["bash", script], cwd=chdir, env=env, stdout=fh, stderr=subprocess.STDOUT)
    set_state(job_id, state="COMPLETED" if code == 0 else "FAILED", exit=f"{code}:0")
    sys.exit(0)

with (STATE / "calls.jsonl").open("a") as fh:
    fh.write(json.dumps([prog, *args]) + "\n")

if prog == "sbatch":
    if os.environ.get("FAKE_SBATCH_REJECT"):
        print("sbatch: error: Batch job submission failed: Invalid partition name specified", file=sys.stderr)
        sys.exit(1)
    script = Path(args[-1])
    opts = dict(line[len("#SBATCH --"):].partition("=")[::2] for line in script.read_text().splitlines()
                if line.startswith("#SBATCH --"))
    opts.update(a[2:].partition("=")[::2] for a in args[:-1] if a.startswith("--"))  # the command line wins
    job_id = str(random.randint(100000, 999999))
    set_state(job_id, state="PENDING", script=str(script))
    out = opts.get("output", "slurm-%j.out").replace("%j", job_id)
    subprocess.Popen([sys.executable, __file__, "--run-job", job_id, str(script), out, opts.get("chdir", os.getcwd())],
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    print(job_id)
elif prog == "squeue":  # -j ID -h -o %T; a finished job is gone from the controller (MinJobAge passed)
    job_id = args[args.index("-j") + 1]
    rec = json.loads(job_path(job_id).read_text()) if job_path(job_id).exists() else {}
    if rec.get("state") in ("PENDING", "RUNNING"):
        print(rec["state"])
    else:
        print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
        sys.exit(1)
elif prog == "sacct":  # -j ID -X -n -P -o State,ExitCode
    job_id = args[args.index("-j") + 1]
    if job_path(job_id).exists():
        rec = json.loads(job_path(job_id).read_text())
        print(f"{rec['state']}|{rec.get('exit', '0:0')}")
elif prog == "scontrol":
    if args[:2] == ["show", "hostnames"]:
        print("\n".join(args[2].split(",")))
    elif args[:1] == ["requeue"]:
        set_state(args[1], state="REQUEUED")
elif prog == "srun":  # one task on the one node: the command itself
    try:
        os.execvp(args[0], args)
    except OSError as err:
        print(f"slurmstepd: error: execve(): {args[0]}: {err.strerror}", file=sys.stderr)
        sys.exit(2)
"""

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
    """Fake Slurm and kubectl first on PATH; their state (jobs, calls made) in the returned folder."""
    bin_dir, state = tmp_path / "bin", tmp_path / "cluster"
    bin_dir.mkdir()
    state.mkdir()
    for name, source in (("fake_slurm.py", FAKE_SLURM), ("kubectl", FAKE_KUBECTL)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{source}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    for prog in ("sbatch", "squeue", "sacct", "scontrol", "srun"):
        (bin_dir / prog).symlink_to(bin_dir / "fake_slurm.py")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CLUSTER_DIR", str(state))
    monkeypatch.setenv("FAKE_IMAGE_WORKDIR", str(ROOT))  # the image's WORKDIR: the project
    return state


def _calls(state: Path, prog: str) -> list[list[str]]:
    path = state / "calls.jsonl"
    calls = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [c for c in calls if c[0] == prog]


def _untried_train_task():
    from tasks.stages import train_task

    return train_task.with_options(retries=0)


@pytest.mark.slow
def test_slurm_launcher_trains_the_same_run_as_a_local_launch(tmp_path, cluster, tiny_manifest, prefect_harness):
    from tasks.stages import train_task

    work = tmp_path / "shared"
    slurm = [*SHORT, "train.launcher=slurm", "train.slurm.gpus_per_node=0", "train.slurm.poll_seconds=0.3"]
    local = tiny_config(work, *SHORT)
    rdir = run_dir(local, tiny_manifest)

    # a job that fails on its node (no such python there): the error names the job and its log
    broken = tiny_config(work, *slurm, "train.slurm.python=/nonexistent/python")
    with pytest.raises(TrainingError) as err:
        _untried_train_task()(broken, tiny_manifest, {})
    (first,) = cluster.glob("slurm-*.json")
    failed_id, msg = first.stem.split("-")[1], str(err.value)
    assert f"Slurm job {failed_id} ended FAILED (exit 2:0) without the final checkpoint" in msg
    assert f"log: {rdir / f'slurm-{failed_id}.out'}" in msg and "resumes from the latest checkpoint" in msg
    assert "execve(): /nonexistent/python: No such file or directory" in msg  # the log's last lines
    assert not isinstance(err.value, ClusterError)  # the train task retries it

    # the real job: same run directory as a local launch (the launcher is not part of the run's identity)
    cfg = tiny_config(work, *slurm)
    info = train_task(cfg, tiny_manifest, {"DIFFLM_TEST_ENV": "through sbatch"})
    assert info["run_dir"] == str(rdir) and not info["reused"] and Path(info["checkpoint"]).is_dir()
    assert Path(info["checkpoint"]).name == "iter_0000004" and (rdir / "curves.png").exists()
    assert [Path(c[-1]) for c in _calls(cluster, "sbatch")] == [rdir / "launch.sbatch"] * 2
    job_id = json.loads((rdir / "slurm-job.json").read_text())["job_id"]
    log = (rdir / f"slurm-{job_id}.out").read_text()
    assert "[train] mode=difflm-noshift start_iter=0" in log
    script = (rdir / "launch.sbatch").read_text()
    assert script == slurm_script(
        cfg, rdir / "config.yaml", rdir / "data_manifest.json", rdir, env={"DIFFLM_TEST_ENV": "through sbatch"}
    )
    assert "#SBATCH --gpus-per-node" not in script and "export DIFFLM_TEST_ENV='through sbatch'" in script

    # a local launch of the same config reuses it, and so does the slurm launcher, without submitting
    assert launch_training(local, tiny_manifest, echo=lambda _: None) == {**info, "reused": True}
    assert train_task(cfg, tiny_manifest, {}) == {**info, "reused": True}
    assert len(_calls(cluster, "sbatch")) == 2


@pytest.mark.slow
def test_kubernetes_launcher_trains_the_same_run_as_a_local_launch(
    tmp_path, cluster, tiny_manifest, prefect_harness, monkeypatch
):
    from tasks.stages import train_task

    work = tmp_path / "pvc" / "difflm"  # the claim is mounted at tmp_path/pvc in the worker and the pods
    k8s = [
        *SHORT,
        "train.launcher=kubernetes",
        f"train.kubernetes.mount={tmp_path / 'pvc'}",
        "train.kubernetes.gpus_per_pod=0",
        "train.kubernetes.poll_seconds=0.3",
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
    assert info["run_dir"] == str(rdir) and not info["reused"] and Path(info["checkpoint"]).name == "iter_0000004"
    verbs = [c[1] for c in _calls(cluster, "kubectl") if c[1] in ("apply", "delete")]
    assert verbs == ["apply", "delete", "apply"]
    job = yaml.safe_load((rdir / "pytorchjob.yaml").read_text())
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert {"name": "DIFFLM_TEST_ENV", "value": "into the pod"} in container["env"] and "resources" not in container
    assert container["command"][container["command"].index("--run-dir") + 1] == str(rdir)
    assert "[train] mode=difflm-noshift" in (tmp_path / "cluster" / f"pod-{name}-master-0.log").read_text()

    assert launch_training(local, tiny_manifest, echo=lambda _: None) == {**info, "reused": True}
    assert train_task(cfg, tiny_manifest, {}) == {**info, "reused": True}
    assert len([c for c in _calls(cluster, "kubectl") if c[1] == "apply"]) == 2


# ---- without training: submission problems, reattachment, timeouts ------------------------------------------

MANIFEST = {"hash": "0123456789abcdef", "dir": "/nowhere", "splits": {}}  # a run that is never trained here


def test_slurm_submission_problems_are_cluster_errors(tmp_path, cluster, monkeypatch):
    cfg = tiny_config(tmp_path, "train.launcher=slurm", "train.slurm.poll_seconds=0.1")
    monkeypatch.setenv("FAKE_SBATCH_REJECT", "1")
    with pytest.raises(ClusterError, match="sbatch did not take .*launch.sbatch: sbatch: error: .*Invalid partition"):
        submit_slurm(cfg, MANIFEST, echo=lambda _: None)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ClusterError, match="`sbatch` is not on the PATH .* Slurm login node"):
        submit_slurm(cfg, MANIFEST, echo=lambda _: None)


def test_slurm_reattaches_to_the_job_of_its_run(tmp_path, cluster):
    """A rerun (retry, restarted worker) waits for the job still queued for its run instead of submitting another;
    a job that ends without the final checkpoint is a failure whatever Slurm says."""
    cfg = tiny_config(tmp_path, "train.launcher=slurm", "train.slurm.poll_seconds=0.1")
    rdir = run_dir(cfg, MANIFEST)
    rdir.mkdir(parents=True)
    (rdir / "slurm-job.json").write_text(json.dumps({"job_id": "4242"}))
    job = cluster / "slurm-4242.json"
    job.write_text(json.dumps({"state": "PENDING"}))
    (rdir / "slurm-4242.out").write_text("[train] old line, before this launcher attached\n")

    def run_then_end():
        time.sleep(0.5)
        job.write_text(json.dumps({"state": "RUNNING"}))
        with (rdir / "slurm-4242.out").open("a") as fh:
            fh.write("[train] iter 2/20 loss 6.1\n")
        time.sleep(0.5)
        job.write_text(json.dumps({"state": "COMPLETED", "exit": "0:0"}))

    threading.Thread(target=run_then_end, daemon=True).start()
    lines: list[str] = []
    with pytest.raises(
        TrainingError,
        match=r"job 4242 ended COMPLETED \(exit 0:0\) without the final checkpoint "
        r"\(no checkpoint yet, of 20\); log: .*slurm-4242.out",
    ):
        submit_slurm(cfg, MANIFEST, echo=lines.append)
    assert not _calls(cluster, "sbatch")
    assert "[slurm] job 4242 of this run is still PENDING: waiting for it instead of submitting another" in lines
    assert "[train] iter 2/20 loss 6.1" in lines and not any("old line" in x for x in lines)
    assert [x for x in lines if x.startswith("[slurm] job 4242: ")] == [
        "[slurm] job 4242: PENDING",
        "[slurm] job 4242: RUNNING",
        "[slurm] job 4242: COMPLETED",
    ]


def test_kubernetes_problems_are_cluster_errors(tmp_path, cluster):
    mount = tmp_path / "pvc"
    outside = tiny_config(tmp_path / "elsewhere", "train.launcher=kubernetes", f"train.kubernetes.mount={mount}")
    with pytest.raises(ClusterError, match=r"not under train.kubernetes.mount=.*set workdir under it"):
        submit_kubernetes(outside, MANIFEST, echo=lambda _: None)
    assert not _calls(cluster, "kubectl")

    # a job whose pods never start (the image cannot be pulled): a clear error after start_timeout_minutes
    cfg = tiny_config(
        mount / "difflm",
        "train.launcher=kubernetes",
        f"train.kubernetes.mount={mount}",
        "train.kubernetes.image=registry.example/unpullable:1",
        "train.kubernetes.poll_seconds=0.1",
        "train.kubernetes.start_timeout_minutes=0.01",
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
    """`difflm launch` options override train.slurm.* / train.kubernetes.*; the file is the one a launcher submits."""
    from flows.cli import main

    work = session_dir / "shared"  # where tiny_manifest's data is: reused
    overrides = [f"workdir={work}", "train.train_iters=7", "train.warmup_iters=1"]
    assert main(["launch", "--preset", "test-tiny", *overrides, "--partition", "gpu", "--time", "01:00:00"]) == 0
    cfg = tiny_config(work, *overrides[1:], "train.slurm.partition=gpu", "train.slurm.time=01:00:00")
    rdir = run_dir(cfg, tiny_manifest)
    written = (rdir / "launch.sbatch").read_text()
    submit = f"submit: sbatch --time=01:00:00 --partition=gpu {rdir / 'launch.sbatch'}\n"
    assert submit in capsys.readouterr().out and "--partition" not in written  # sbatch arguments, not #SBATCH lines
    assert written == write_launch_file(cfg, tiny_manifest, "slurm").read_text()
    assert main(["launch", "--preset", "test-tiny", *overrides, "--target", "k8s", "--image", "img:2"]) == 0
    assert "is not under train.kubernetes.mount=/data" in capsys.readouterr().err  # a warning, the file is written
    job = yaml.safe_load((rdir / "pytorchjob.yaml").read_text())
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"] == "img:2"


def test_cluster_deployments_resolve_to_their_launchers():
    """The prefect.yaml entries pretrain-difflm/slurm and /kubernetes give valid configs for their launcher."""
    from difflm.config import load_config
    from models.launch.cluster import mount_problem

    entries = {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    for name in ("slurm", "kubernetes"):
        params = entries[name]["parameters"]
        cfg = load_config(params["preset"], params["overrides"])
        assert cfg.train.launcher == name and Path(cfg.workdir).is_absolute()
        # the launcher does not change the run: the same run directory as the local deployment's config
        assert cfg.stage_hash("train") == load_config(params["preset"]).stage_hash("train")
    k8s = load_config(entries["kubernetes"]["parameters"]["preset"], entries["kubernetes"]["parameters"]["overrides"])
    assert mount_problem(k8s, Path(k8s.workdir) / "runs" / "r") is None
