"""`train.launch.launcher=slurm` on a real Slurm cluster (the `slurm_cluster` fixture: munge, slurmctld and slurmd on this
host, deploy/slurm_local.py): the real sbatch runs the launch script, srun runs torchrun (gloo, CPU), the launcher
follows the job through squeue/scontrol, and a preemption requeues the job, which resumes bit for bit. Without
Slurm (not root, no apt) these tests are skipped; under `$CI` they fail."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from fault_injection import fault_launch
from helpers import SHORT_RUN as SHORT
from helpers import assert_same_weights, manifest_record, tiny_config
from prep_gate import Gate
from scenarios import SCENARIOS
from servers import BIN, stop

from difflm.data_prep import pipeline
from difflm.data_prep.pipeline import SubmittedToCluster, prepare_data
from difflm.data_prep.steps import SplitSourceWriter
from difflm.flows.cli import main
from difflm.models.hf.convert import load_megatron_weights
from difflm.models.launch import slurm as slurm_launch
from difflm.models.launch.cluster import SLURM_ACTIVE, ClusterError, slurm_job_state, slurm_script, submit_slurm
from difflm.models.launch.torchrun import TrainingError, is_finished, launch_training, read_metrics, run_dir
from difflm.rundir import TrainResult
from difflm.tasks.stages import train_task

SLURM = ["train.launch.launcher=slurm", "train.launch.slurm.gpus_per_node=0", "train.launch.wait.poll_seconds=0.3"]
ROOT = Path(__file__).resolve().parents[2]
SCENARIO = SCENARIOS["slurm"]  # the pipeline through prefect.yaml's Slurm deployment
MANIFEST = manifest_record("0123456789abcdef", "/nowhere")  # a run that is never trained here


def _slurm(*args: str) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _job_logs(rdir: Path) -> list[Path]:
    return sorted(rdir.glob("slurm-*.out"))


def _untried_train_task():
    return train_task.with_options(retries=0)


@pytest.mark.slow
def test_slurm_launcher_trains_the_same_run_as_a_local_launch(
    tmp_path, slurm_cluster, tiny_manifest, prefect_harness, monkeypatch
):
    work = tmp_path / "shared"
    local = tiny_config(work, *SHORT)
    rdir = run_dir(local, tiny_manifest)

    # a job that fails on its node (its python's interpreter is not there): the error names the job, its exit code
    # and its log
    python = tmp_path / "python"
    python.write_text("#!/nonexistent/python\n")
    python.chmod(0o755)
    broken = tiny_config(work, *SHORT, *SLURM, f"train.launch.slurm.python={python}")
    # the submitter's check (it runs the python with -c) would refuse this one here: skipped, as when the nodes'
    # copy of the shared filesystem differs from the submitter's
    with pytest.raises(TrainingError) as err, monkeypatch.context() as patch:
        patch.setattr(slurm_launch, "_check_python", lambda python: None)
        _untried_train_task()(broken, tiny_manifest, {})
    failed_id, msg = json.loads((rdir / "slurm-job.json").read_text())["job_id"], str(err.value)
    assert f"Slurm job {failed_id} ended FAILED (exit 2:0) without the final checkpoint" in msg
    assert f"log: {rdir / f'slurm-{failed_id}.out'}" in msg and "resumes from the latest checkpoint" in msg
    assert "execve(): bad interpreter(/nonexistent/python): No such file or directory" in msg  # the log's last lines
    assert not isinstance(err.value, ClusterError)  # the train task retries it

    # the real job: same run directory as a local launch (the launcher is not part of the run's identity); the
    # worker's credentials reach it through a private file, not the job environment that Slurm stores
    secrets = {"MLFLOW_TRACKING_PASSWORD": f"pw-{os.urandom(8).hex()}", "HF_TOKEN": f"hf-{os.urandom(8).hex()}"}
    for key, value in secrets.items():
        monkeypatch.setenv(key, value)
    cfg = tiny_config(work, *SHORT, *SLURM)
    info = train_task(cfg, tiny_manifest, {"DIFFLM_TEST_ENV": "through sbatch"})
    assert info.run.path == rdir and not info.reused and info.checkpoint.is_dir()
    assert info.checkpoint.name == "iter_0000004" and (rdir / "curves.png").exists()
    job_id = json.loads((rdir / "slurm-job.json").read_text())["job_id"]
    assert job_id != failed_id and len(_job_logs(rdir)) == 2
    log = (rdir / f"slurm-{job_id}.out").read_text()
    assert "[train] mode=difflm-noshift start_iter=0" in log
    creds = rdir / ".credentials" / "slurm-job.env"
    assert f"difflm: credentials read from {creds}: HF_TOKEN MLFLOW_TRACKING_PASSWORD" in log
    assert not creds.exists()  # removed when the job ended
    state = slurm_cluster.root / "state"
    stored = state / f"hash.{int(job_id) % 10}" / f"job.{job_id}" / "environment"
    assert f"DIFFLM_CREDENTIALS_FILE={creds}".encode() in stored.read_bytes()
    for path in (p for p in state.rglob("*") if p.is_file()):  # the job's environment and script, job_state
        assert not any(v.encode() in path.read_bytes() for v in secrets.values()), path
    script = (rdir / "launch.sbatch").read_text()
    assert script == slurm_script(
        cfg, rdir / "config.yaml", rdir / "data_manifest.json", rdir, env={"DIFFLM_TEST_ENV": "through sbatch"}
    )
    assert "#SBATCH --gpus-per-node" not in script and "export DIFFLM_TEST_ENV='through sbatch'" in script

    # a local launch of the same config reuses it, and so does the slurm launcher, without submitting
    assert launch_training(local, tiny_manifest, echo=lambda _: None) == replace(info, reused=True)
    assert train_task(cfg, tiny_manifest, {}) == replace(info, reused=True)
    assert len(_job_logs(rdir)) == 2


@pytest.mark.slow
def test_a_two_node_job_written_by_difflm_launch_and_submitted_by_hand_trains(
    session_dir, slurm_cluster, tiny_manifest, capsys
):
    """`difflm launch --target slurm train.launch.nnodes=2`, then `sbatch` by hand: on the cluster's two nodes (two slurmd
    on this host) srun starts one torchrun per node and they meet at the c10d rendezvous on the first node (a
    rendezvous of --nnodes 2 completes only with both)."""
    if len(slurm_cluster.nodes) < 2:
        pytest.skip("one node only: this host's short name is `localhost`")
    work = session_dir / "shared"  # where tiny_manifest's data is: reused
    overrides = [*SHORT, "train.launch.nnodes=2", "train.micro_batch_size=2", "train.launch.slurm.gpus_per_node=0"]
    assert main(["launch", "--preset", "test-tiny", f"workdir={work}", *overrides]) == 0
    cfg = tiny_config(work, *overrides)
    rdir = run_dir(cfg, tiny_manifest)
    printed = [x for x in capsys.readouterr().out.splitlines() if x.startswith("submit: sbatch ")]
    assert len(printed) == 1 and printed[0].endswith(str(rdir / "launch.sbatch"))
    sbatch, *options = shlex.split(printed[0].removeprefix("submit: "))  # the command difflm launch prints
    job_id = _slurm(sbatch, "--parsable", *options)
    _until(lambda: slurm_job_state(job_id)[0] not in SLURM_ACTIVE)
    log = (rdir / f"slurm-{job_id}.out").read_text()
    assert slurm_job_state(job_id) == ("COMPLETED", "0:0"), log[-3000:]
    met = re.search(rf"difflm: job {job_id} on 2 node\(s\) (\S+), rendezvous (\S+):(\d+)", log)
    assert met, log[-3000:]
    hosts = _slurm("scontrol", "show", "hostnames", met.group(1)).split()
    assert sorted(hosts) == sorted(slurm_cluster.nodes) and met.group(2) == hosts[0]  # the first node hosts it
    assert int(met.group(3)) == 20000 + int(job_id) % 10000
    assert is_finished(cfg, rdir) and "#SBATCH --nodes=2" in (rdir / "launch.sbatch").read_text()


# ---- preemption: scancel --signal=USR1 --batch, checkpoint, requeue, resume --------------------------------

# long enough (~10 ms a step on an idle machine) for the signal, sent once step 2 is logged, to come well before
# the end (it came at step 3 in the runs here)
PREEMPT_ITERS = 100
PREEMPT = [f"train.train_iters={PREEMPT_ITERS}", "train.schedule.warmup_iters=1", "checkpoint.save_interval=50"]
PREEMPT += ["train.log_interval=1", f"train.eval_interval={PREEMPT_ITERS}", "train.eval_iters=1"]


@pytest.fixture(scope="module")
def preempt_reference(tmp_path_factory, tiny_manifest) -> TrainResult:
    """The uninterrupted local run of PREEMPT that the preempted jobs must end equal to, bit for bit."""
    work = tmp_path_factory.mktemp("preempt-ref")
    return launch_training(tiny_config(work, *PREEMPT), tiny_manifest, echo=lambda _: None)


def _weights(checkpoint: str) -> dict:
    return load_megatron_weights(Path(checkpoint))


def _until(predicate, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.2)


RELEASE_AFTER = 2.0  # seconds a requeued job stays held before the test starts it


def _release_requeued(job_id: str, done: threading.Event) -> None:
    """Slurm holds a requeued batch job (BeginTime, 20 minutes by its credential lifetime); as an admin would, start
    it sooner, but not in the second of the requeue. slurmd revoked the old run's credential at that second, and a
    new launch credential must be younger than the revocation: one issued in the same second is refused as revoked
    (`Job N already killed, do not launch batch job`), and Slurm kills the job without running its script. Once, on
    CI, a release at once ended the test's job that way (exit 1:0, nothing in its log after the requeue)."""
    held_since: float | None = None
    while not done.is_set():
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True).stdout
        if state.split() != ["PENDING", "BeginTime"]:
            held_since = None
        elif held_since is None:
            held_since = time.monotonic()
        elif time.monotonic() - held_since >= RELEASE_AFTER:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
        time.sleep(0.5)


# a flow's worker as its own process, waiting for the Slurm job of a run (killed by the test mid-way)
WORKER = """
import sys
from difflm.config import load_config
from difflm.manifest import DataManifest
from difflm.models.launch.cluster import submit_slurm
workdir, manifest, *overrides = sys.argv[1:]
submit_slurm(load_config("test-tiny", [f"workdir={workdir}", *overrides]), DataManifest.read(manifest), echo=print)
"""


def _requeued(job_id: str) -> bool:
    """The job is back in the queue after `scontrol requeue`, held by Slurm until its BeginTime."""
    return _slurm("squeue", "-h", "-j", job_id, "-o", "%T %r").split() == ["PENDING", "BeginTime"]


@pytest.mark.slow
def test_preempted_job_checkpoints_requeues_and_resumes_bit_for_bit(
    tmp_path, slurm_cluster, tiny_manifest, preempt_reference
):
    """scancel --signal=USR1 --batch (what a preempting scheduler sends): the job checkpoints and requeues itself;
    the worker waiting for it keeps waiting; a restarted worker (or a Prefect retry) reattaches to the requeued job
    instead of submitting another, and the job resumes and ends with the weights of an uninterrupted run."""
    work = tmp_path / "shared"
    cfg = tiny_config(work, *PREEMPT, *SLURM)
    rdir = run_dir(cfg, tiny_manifest)
    worker_log = tmp_path / "worker.log"
    with worker_log.open("w") as fh:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER,
                str(work),
                str(tiny_manifest.write(tmp_path / "manifest.json")),
                *PREEMPT,
                *SLURM,
            ],
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    done = threading.Event()
    try:
        _until(lambda: any(r.get("step", 0) >= 2 for r in read_metrics(rdir) if "loss" in r))
        job_id = json.loads((rdir / "slurm-job.json").read_text())["job_id"]
        _slurm("scancel", "--signal=USR1", "--batch", job_id)
        _until(lambda: _requeued(job_id))
        time.sleep(1.0)  # a poll of the worker sees it pending
        worker.kill()  # the worker is lost while its job waits in the queue
        worker.wait()
        threading.Thread(target=_release_requeued, args=(job_id, done), daemon=True).start()
        lines: list[str] = []
        info = submit_slurm(cfg, tiny_manifest, echo=lines.append)  # the retry
    finally:
        done.set()
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    followed = worker_log.read_text()
    assert f"[slurm] submitted job {job_id}" in followed and f"[slurm] job {job_id}: RUNNING" in followed
    assert f"[slurm] job {job_id}: PENDING" in followed.split(f"[slurm] job {job_id}: RUNNING", 1)[1]
    assert f"[slurm] job {job_id} of this run is still PENDING: waiting for it instead of submitting another" in lines
    log = (rdir / f"slurm-{job_id}.out").read_text()
    assert "difflm: preemption signal: checkpointing" in log and f"requeueing job {job_id}" in log
    saved = re.search(r"\[train\] stopping at iter (\d+) \(SIGTERM received\): checkpoint saved", log)
    assert saved, f"the trainer did not checkpoint on the signal:\n{log[-3000:]}"
    preempted_at = int(saved.group(1))
    assert 2 <= preempted_at < PREEMPT_ITERS and f"start_iter={preempted_at}" in log  # the requeued job resumed
    assert len(_job_logs(rdir)) == 1 and json.loads((rdir / "slurm-job.json").read_text())["job_id"] == job_id
    assert info.checkpoint.name == f"iter_{PREEMPT_ITERS:07d}" and not info.reused
    assert_same_weights(_weights(info.checkpoint), _weights(preempt_reference.checkpoint))


# ---- the time limit: --signal=B:USR1@N before it, checkpoint, requeue, resume ---------------------------------

# a one-minute limit and a signal 55 s before it: Slurm sends it at its first time-limit check after the job
# starts (the controller checks every 30 s and may signal up to 60 s early), i.e. 0-30 s into the job
# two minutes, signalled 115 s before the end: the signal comes at the first time-limit check, ~30 s in, and the
# requeued job has the whole limit (one minute was too close once the resumed job also had to start up)
TIME_LIMIT = ["train.launch.slurm.time=2", "train.launch.slurm.signal_seconds=115"]
TICK = "debug2: Testing job time limits and checkpoints"  # slurmctld's time-limit check, logged at debug2
STEP_SLEEP = 0.6  # 100 steps: ~60 s from scratch, so the signal, ~30 s after the job starts, finds it training
# (once, on CI, it came ~20 s late and found the job at step 88 of 100: the margin is for that)


def _ticks(cluster) -> int:
    return cluster.log_file("slurmctld").read_text(errors="replace").count(TICK)


def _release_requeued_of(rdir: Path, done: threading.Event) -> None:
    """`_release_requeued` for the job of `rdir`, once it is submitted."""
    record = rdir / "slurm-job.json"
    while not done.is_set() and not record.exists():
        time.sleep(0.2)
    if record.exists():
        _release_requeued(json.loads(record.read_text())["job_id"], done)


@pytest.mark.slow(reason="a Slurm job runs into its time limit (a minute: Slurm's least), requeues and resumes")
def test_time_limit_signal_checkpoints_requeues_and_resumes_bit_for_bit(
    tmp_path, slurm_cluster, tiny_manifest, preempt_reference
):
    """A job of two minutes with `train.launch.slurm.signal_seconds=115` (`#SBATCH --signal=B:USR1@115`): Slurm, not the
    test, signals the batch shell before the limit; the job checkpoints, requeues itself and resumes, and ends
    with the weights of an uninterrupted run. The job is submitted just after one of the controller's 30-s
    time-limit checks, so the signal comes at the next one, ~30 s in: the trainer (slowed down, from scratch
    only, by tests/support/fault_injection.py) is then training, not starting up. The requeued job is released at once
    (as in the test above) and, at full speed, ends well inside its own limit."""
    cfg = tiny_config(tmp_path / "shared", *PREEMPT, *SLURM, *TIME_LIMIT)
    rdir = run_dir(cfg, tiny_manifest)
    done = threading.Event()
    _slurm("scontrol", "setdebug", "debug2")
    try:
        seen = _ticks(slurm_cluster)
        _until(lambda: _ticks(slurm_cluster) > seen, timeout=45)
        threading.Thread(target=_release_requeued_of, args=(rdir, done), daemon=True).start()
        lines: list[str] = []
        try:
            info = submit_slurm(cfg, tiny_manifest, echo=lines.append, **fault_launch(step_sleep=STEP_SLEEP))
        except Exception as err:  # what the job and the submitter saw: the only trace of a timing problem
            logs = "\n".join(f"--- {p.name}:\n{p.read_text()[-4000:]}" for p in _job_logs(rdir))
            states = [x for x in lines if x.startswith("[slurm]")]  # the job's states, which the training lines hide
            pytest.fail(f"{err}\n--- submitter:\n" + "\n".join(states + lines[-20:]) + f"\n{logs}")
    finally:
        done.set()
        _slurm("scontrol", "setdebug", "info")
    job_id = json.loads((rdir / "slurm-job.json").read_text())["job_id"]
    script = (rdir / "launch.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@115" in script and "-m fault_injection" in script
    submitted = [x for x in lines if x.startswith("[slurm] submitted job ")]  # one job, requeued under its id
    assert len(submitted) == 1 and submitted[0].startswith(f"[slurm] submitted job {job_id} ")
    log = (rdir / f"slurm-{job_id}.out").read_text()
    assert "difflm: preemption signal: checkpointing" in log and f"requeueing job {job_id}" in log, log[-3000:]
    saved = re.search(r"\[train\] stopping at iter (\d+) \(SIGTERM received\): checkpoint saved", log)
    assert saved, f"the trainer did not checkpoint on the signal:\n{log[-3000:]}"
    preempted_at = int(saved.group(1))
    assert 1 <= preempted_at < PREEMPT_ITERS and f"start_iter={preempted_at}" in log  # the requeued job resumed
    assert "DUE TO TIME LIMIT" not in log  # signalled before the limit, never killed by it
    assert info.checkpoint.name == f"iter_{PREEMPT_ITERS:07d}" and not info.reused
    assert_same_weights(_weights(info.checkpoint), _weights(preempt_reference.checkpoint))


# ---- without training: submission problems, reattachment ---------------------------------------------------


def test_slurm_submission_problems_are_cluster_errors(tmp_path, slurm_cluster, monkeypatch):
    cfg = tiny_config(tmp_path, *SLURM, "train.launch.slurm.partition=nosuch")
    with pytest.raises(
        ClusterError, match="sbatch did not take .*launch.sbatch: sbatch: error: invalid partition specified: nosuch"
    ):
        submit_slurm(cfg, MANIFEST, echo=lambda _: None)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ClusterError, match="`sbatch` is not on the PATH .* Slurm login node"):
        submit_slurm(cfg, MANIFEST, echo=lambda _: None)


def test_slurm_reattaches_to_the_job_of_its_run(tmp_path, slurm_cluster):
    """A rerun (retry, restarted worker) waits for the job still queued for its run instead of submitting another;
    a job that ends without the final checkpoint is a failure whatever Slurm says."""
    cfg = tiny_config(tmp_path, *SLURM)
    rdir = run_dir(cfg, MANIFEST)
    rdir.mkdir(parents=True)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\necho '[train] iter 2/20 loss 6.1'\nsleep 1\n")
    job_id = _slurm("sbatch", "--parsable", "--hold", f"--output={rdir}/slurm-%j.out", str(script))
    (rdir / "slurm-job.json").write_text(json.dumps({"job_id": job_id}))
    threading.Timer(1.0, _slurm, args=("scontrol", "release", job_id)).start()
    lines: list[str] = []
    with pytest.raises(
        TrainingError,
        match=rf"job {job_id} ended COMPLETED \(exit 0:0\) without the final checkpoint "
        rf"\(no checkpoint yet, of 20\); log: .*slurm-{job_id}.out",
    ):
        submit_slurm(cfg, MANIFEST, echo=lines.append)
    assert f"[slurm] job {job_id} of this run is still PENDING: waiting for it instead of submitting another" in lines
    assert "[train] iter 2/20 loss 6.1" in lines and not (rdir / "launch.sbatch").exists()  # nothing submitted
    states = [
        x.removeprefix(f"[slurm] job {job_id}: ").split()[0] for x in lines if x.startswith(f"[slurm] job {job_id}: ")
    ]
    assert states[0] == "PENDING" and "RUNNING" in states and states[-1] == "COMPLETED"


# ---- data prep: datatrove's Slurm executor, a job array of tasks ----------------------------------------------


def _prep_jobs() -> list[tuple[str, str, str]]:
    """(job id, state, reason) of the data-prep jobs still in the queue."""
    out = _slurm("squeue", "-h", "-n", "difflm-prep", "-o", "%i %T %r")
    return [tuple(line.split()[:3]) for line in out.splitlines() if line.strip()]


def _prep_settled() -> bool:
    """Every data-prep task has ended (datatrove's merge-stats job may wait for ever on a cancelled task)."""
    return all(reason == "DependencyNeverSatisfied" for _, _, reason in _prep_jobs())


def _gated(gate: Path, rank: int, after: int):
    """`cleaning_steps` with tests/support/prep_gate.py's Gate at the end: task `rank` stops mid-way while `gate` exists."""
    real = pipeline.cleaning_steps
    return lambda cfg: [*real(cfg), Gate(str(gate), rank, after)]


@pytest.mark.slow
def test_data_prep_on_slurm_writes_the_local_shards_byte_for_byte(tmp_path, slurm_cluster, tiny_manifest, monkeypatch):
    """Two tasks of three are lost: one is cancelled before it starts, one is killed mid-way (it has read its
    input and begun writing its shards). The rerun submits both again, and the shards equal the local ones."""
    src = tmp_path / "docs.jsonl"
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    src.write_text("".join(json.dumps({"text": f"doc {i}: " + " ".join(words[i % 8 :] * 9)}) + "\n" for i in range(40)))
    common = [f"tokenizer.path={tiny_manifest.tokenizer.path}", "data.min_chars=0", f"data.sources=[{src}]"]
    common += ["data.valid_fraction=0.25", "data.tasks=3", "data.workers=3"]
    local = prepare_data(tiny_config(tmp_path / "local", *common))
    cfg = tiny_config(tmp_path / "slurm", *common, "data.executor=slurm", "data.slurm.mem_per_cpu_gb=1")
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setattr(pipeline, "cleaning_steps", _gated(gate, rank=2, after=4))
    real_init = SplitSourceWriter.__init__  # batches of 2 documents: two batches are written before the gate
    monkeypatch.setattr(SplitSourceWriter, "__init__", lambda self, *a, **kw: real_init(self, *a, batch_size=2))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(ROOT / "tests" / "support"), os.environ.get("PYTHONPATH", "")])
    )
    secret = f"tok-{os.urandom(8).hex()}"  # a reader's credential (an S3 key, a hub token): never in Slurm's state
    monkeypatch.setenv("DIFFLM_TEST_SOURCE_TOKEN", secret)
    # the partition is down while the first array is submitted: one task is cancelled for sure before it runs
    _slurm("scontrol", "update", "PartitionName=debug", "State=DOWN")
    try:
        with pytest.raises(SubmittedToCluster, match="submitted 3 data-prep tasks to Slurm"):
            prepare_data(cfg)
        array = next(job for job, _, _ in _prep_jobs() if job.endswith("_[0-2]")).split("_")[0]
        stored = [p for p in (slurm_cluster.root / "state").rglob("*") if p.is_file()]
        assert any(p.name == "environment" for p in stored)  # the jobs' environments, stored by Slurm
        assert not [p for p in stored if secret.encode() in p.read_bytes()]
        _slurm("scancel", f"{array}_1")  # task 1 is lost (a node failure, a cancelled task)
    finally:
        _slurm("scontrol", "update", "PartitionName=debug", "State=UP")
    _until(lambda: Path(f"{gate}.reached").exists(), timeout=120)  # task 2 is mid-way, held at the gate
    assert (f"{array}_2", "RUNNING") in [(job, state) for job, state, _ in _prep_jobs()]
    (out,) = (tmp_path / "slurm" / "data").glob("*/logs")
    creds = out.parent / ".credentials" / "slurm-prep.env"
    assert creds.stat().st_mode & 0o777 == 0o600 and secret in creds.read_text()
    partial = sorted(p.name for p in out.parent.rglob("00002_tokens.*"))
    assert partial, "task 2 had written nothing yet"  # it has begun its shards
    _slurm("scancel", f"{array}_2")  # killed mid-way (SIGTERM, then SIGKILL)
    _until(_prep_settled)
    killed = (out / "slurm_logs" / f"{array}_2.out").read_text()
    assert "Reading input file docs.jsonl" in killed and f"JOB {array} ON" in killed and "CANCELLED" in killed
    read = re.search(f"difflm: credentials read from {re.escape(str(creds))}: (.*)", killed)
    assert read and "DIFFLM_TEST_SOURCE_TOKEN" in read.group(1).split()
    assert not (out / "completions" / "00002").exists()
    gate.unlink()  # the rerun's tasks pass
    with pytest.raises(SubmittedToCluster, match="submitted 2 data-prep tasks"):  # the rerun resubmits 1 and 2
        prepare_data(cfg)
    _until(_prep_settled)
    manifest = prepare_data(cfg)
    assert not creds.exists()  # the prep is complete: its jobs need it no more

    out, ref = Path(manifest.dir), Path(local.dir)
    shards = sorted(p.relative_to(ref) for p in ref.rglob("*_tokens.*"))
    assert len(shards) >= 6 and shards == sorted(p.relative_to(out) for p in out.rglob("*_tokens.*"))
    assert all((out / p).read_bytes() == (ref / p).read_bytes() for p in shards)
    moved = json.loads(json.dumps(local.to_dict()["splits"]).replace(str(ref), str(out)))
    assert manifest.to_dict()["splits"] == moved


# ---- Prefect: the Slurm deployment of prefect.yaml, a process worker, the pipeline on the cluster -------------


@pytest.mark.slow(
    reason="prefect.yaml's Slurm deployment end to end: a Prefect server, a worker, the pipeline with training as a job"
)
def test_the_slurm_deployment_runs_the_pipeline_on_the_cluster(tmp_path, slurm_cluster, prefect_server):
    """`prefect deploy --name slurm` from prefect.yaml, a process worker of the pool `difflm` (on the "login node":
    sbatch on its PATH, SLURM_CONF in its environment), and a run with the test preset: data prep on the worker,
    training as a Slurm job that the flow follows, then export and evaluation on the worker."""
    work = tmp_path / "work"
    # the deployment's pull step: set_working_directory {{ $PWD }}
    server = prefect_server(PWD=str(ROOT), PREFECT_LOCAL_STORAGE_PATH=str(tmp_path / "results"))
    env = server.env
    prefect = str(BIN / "prefect")
    worker = None
    try:
        for cmd in (
            ["work-pool", "create", "difflm", "--type", "process"],
            ["--no-prompt", "deploy", "--name", "slurm"],
        ):
            done = subprocess.run([prefect, *cmd], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stdout + done.stderr
        worker_log = tmp_path / "worker.log"
        worker = subprocess.Popen(
            [prefect, "worker", "start", "--pool", "difflm"], env=env, cwd=ROOT, stdout=worker_log.open("w"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        params = json.dumps(SCENARIO.params(work))
        run = subprocess.run(
            [prefect, "deployment", "run", SCENARIO.deployment, "--params", params, "--watch"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0 and "Completed" in run.stdout, run.stdout + worker_log.read_text()[-5000:]
    finally:
        if worker is not None:
            stop(worker)
        server.stop()
    SCENARIO.check(work)
    (rdir,) = work.glob("runs/*/slurm-job.json")
    assert f"[slurm] submitted job {json.loads(rdir.read_text())['job_id']}" in worker_log.read_text()
