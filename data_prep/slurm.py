"""Data prep on Slurm (`data.executor=slurm`): datatrove's SlurmPipelineExecutor, one job array of the prep's tasks
and a job that merges their stats, submitted without this process's credentials.

datatrove submits with `sbatch --export=ALL` (and the stats job with sbatch's default, the same), so Slurm would
store every variable of this process's environment with the job, passwords and keys included (difflm/credentials.py).
Here sbatch gets the allow-list of the environment that jobs need (difflm.credentials.job_environment); the credentials (an S3 key or a hub token a reader may
need) go to `<prep>/.credentials/slurm-prep.env`, 0600, which each job's shell reads before it starts datatrove.
The file is removed when the prep is complete; a prep left unfinished keeps it for its rerun.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from datatrove.executor import SlurmPipelineExecutor
from datatrove.executor import slurm as datatrove_slurm

from difflm.config import PARTITION, PipelineConfig
from difflm.credentials import job_environment, read_credentials, write_credentials_file
from difflm.data_prep.errors import DataPrepError

CREDENTIALS = Path(".credentials") / "slurm-prep.env"  # under the prep's output folder


def submit_batch(launch_file_contents: str, job_id_retriever: Callable[[str], str], *args: str) -> str:
    """datatrove's `launch_slurm_job`, with sbatch given the allow-list of this process's environment, without its
    credentials: the script goes to a temporary file, sbatch submits it with `args`; the job id from sbatch's output."""
    clean, _ = job_environment(os.environ)
    with tempfile.NamedTemporaryFile("w", suffix=".slurm") as script:
        script.write(launch_file_contents)
        script.flush()
        out = subprocess.check_output(["sbatch", *args, script.name], env=clean)
    return job_id_retriever(out.decode())


# datatrove calls this module function for both of its submissions (the array and the stats job); every
# submission from a process that prepares data goes through submit_batch. A datatrove without it would
# submit with the credentials: refuse to start instead.
if not callable(getattr(datatrove_slurm, "launch_slurm_job", None)):
    raise ImportError("datatrove.executor.slurm.launch_slurm_job is gone: data_prep/slurm.py needs updating")
datatrove_slurm.launch_slurm_job = submit_batch


def default_partition() -> str:
    """The cluster's default partition (`sinfo` marks it with '*'): datatrove always writes an `#SBATCH
    --partition` line, and one without a value is refused by sbatch."""
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise DataPrepError(f"data.executor=slurm: sinfo failed ({err}); run on a Slurm login node") from None
    for name in proc.stdout.split():
        if name.endswith("*") and PARTITION.fullmatch(name[:-1]):
            return name[:-1]
    raise DataPrepError("data.slurm.partition is not set and Slurm names no default partition: set it")


def env_command(credentials: Path) -> str:
    """The jobs' first line (before datatrove's `set -x`, so nothing it reads is echoed): this environment's bin
    first on PATH, where datatrove's `launch_pickled_pipeline` and `merge_stats` are (the job inherits the
    submitter's PATH, which need not have it), then the credentials file when there is one."""
    return (
        f'export PATH={shlex.quote(str(Path(sys.executable).parent))}:"$PATH"; '
        f"difflm_credentials={shlex.quote(str(credentials))}; "
        f'if [ -f "$difflm_credentials" ]; then {read_credentials("difflm_credentials")}; fi'
    )


def slurm_executor(cfg: PipelineConfig, pipeline: list, out: Path) -> SlurmPipelineExecutor:
    """The executor of the prep writing `out` (its logs in `out`/logs). Writes the credentials of this process's
    environment to the prep's file first; a rerun without any leaves the file of the jobs it may still have queued."""
    credentials = out / CREDENTIALS
    secret = job_environment(os.environ)[1]
    if secret:
        write_credentials_file(credentials, secret)
    d = cfg.data
    return SlurmPipelineExecutor(
        pipeline=pipeline,
        tasks=d.num_tasks,
        time=d.slurm.time,
        partition=d.slurm.partition or default_partition(),
        cpus_per_task=d.slurm.cpus_per_task,
        mem_per_cpu_gb=d.slurm.mem_per_cpu_gb,
        logging_dir=str(out / "logs"),
        job_name="difflm-prep",
        sbatch_args=d.slurm.sbatch_args,
        env_command=env_command(credentials),
    )


def forget_credentials(out: Path) -> None:
    """The prep writing `out` is complete: its jobs need the credentials file no more."""
    (out / CREDENTIALS).unlink(missing_ok=True)
