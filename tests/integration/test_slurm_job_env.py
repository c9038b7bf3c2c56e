"""What the real Slurm stores of a job's environment (issue 50, item 4): jobs get an allow-list of the submitter's
environment (difflm/credentials.py), never the whole of it less a deny-list of names. Secrets under names no
deny-list knows (PGPASSWORD, MYSQL_PWD, AZURE_STORAGE_CONNECTION_STRING) and a user:password@ inside a URL
(PIP_INDEX_URL, HTTPS_PROXY) were stored with the job. A training job still runs:
tests/integration/test_slurm.py::test_slurm_launcher_trains_the_same_run_as_a_local_launch."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from difflm.data_prep import slurm as prep_slurm
from difflm.models.launch.slurm import write_credentials
from difflm.rundir import RunDir

pytestmark = pytest.mark.integration  # a real Slurm cluster

PW = os.urandom(6).hex()  # each secret holds it: none of Slurm's files may
SECRETS = {
    "PGPASSWORD": f"pg-{PW}",
    "MYSQL_PWD": f"my-{PW}",
    "AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=https;AccountName=a;AccountKey=az-{PW}",
    "PIP_INDEX_URL": f"https://deploy:{PW}-pip@pypi.example.org/simple",
    "HTTPS_PROXY": f"http://me:{PW}-proxy@proxy.example.org:3128",
    "MLFLOW_TRACKING_PASSWORD": f"ml-{PW}",
}


def _stored(slurm_cluster, submit: Callable[[dict[str, str]], str]) -> tuple[dict[str, str], list[Path]]:
    """Submit a held job with `submit` (given sbatch's environment: this process's), then what Slurm stored: the
    job's environment (StateSaveLocation/hash.N/job.N/environment) and every file of its state."""
    job_id = submit(dict(os.environ))
    try:
        state = slurm_cluster.root / "state"
        stored = state / f"hash.{int(job_id) % 10}" / f"job.{job_id}" / "environment"
        words = [w for w in stored.read_bytes().decode(errors="replace").split("\0") if "=" in w]
        return dict(w.split("=", 1) for w in words), [p for p in state.rglob("*") if p.is_file()]
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=60)


def _assert_no_secrets(env: dict[str, str], files: list[Path]) -> None:
    assert not set(SECRETS) & set(env), sorted(set(SECRETS) & set(env))
    for path in files:  # the environment, the script, job_state
        try:
            assert PW.encode() not in path.read_bytes(), path
        except FileNotFoundError:  # job_state.new: the controller renames it while we read
            continue
    assert env["PATH"] == os.environ["PATH"] and env["SLURM_CONF"] == os.environ["SLURM_CONF"]  # what jobs need


def test_training_jobs_store_only_an_allow_list_of_the_environment(tmp_path, slurm_cluster, monkeypatch):
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SOME_UNLISTED_SETTING", "x")
    run = RunDir(tmp_path / "run")
    run.path.mkdir()

    def submit(_: dict[str, str]) -> str:  # as submit_slurm does: sbatch in the environment write_credentials gives
        env = write_credentials(run, {"DIFFLM_MLFLOW_RUN_ID": "abc"})
        script = tmp_path / "held.sbatch"
        script.write_text("#!/bin/bash\ntrue\n")
        done = subprocess.run(["sbatch", "--parsable", "--hold", str(script)], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    env, files = _stored(slurm_cluster, submit)
    _assert_no_secrets(env, files)
    assert "SOME_UNLISTED_SETTING" not in env
    creds = Path(env["DIFFLM_CREDENTIALS_FILE"])  # what the job needs of the secrets: in the private file
    text = creds.read_text()
    assert f"ml-{PW}" in text and f"{PW}-proxy" in text and "PGPASSWORD" not in text


def test_data_prep_jobs_store_only_an_allow_list_of_the_environment(tmp_path, slurm_cluster, monkeypatch):
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)

    def submit(_: dict[str, str]) -> str:  # datatrove's call: the script's text, a job-id parser, sbatch's options
        return prep_slurm.submit_batch("#!/bin/bash\ntrue\n", lambda out: out.split()[-1], "--hold", "--export=ALL")

    env, files = _stored(slurm_cluster, submit)
    _assert_no_secrets(env, files)
