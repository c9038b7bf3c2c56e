"""Cluster launch files for the same trainer entry point, and the names callers import: a Slurm batch script
(`difflm.models.launch.slurm`) and a Kubernetes PyTorchJob (`difflm.models.launch.kubernetes`), both waited for by
`difflm.models.launch.jobs.wait_for_job`. `write_launch_file` writes either (`difflm launch`); `submit_slurm` /
`submit_kubernetes` also submit it, wait for the job and return what `launch_training` returns (`train.launch.launcher`).
"""

from __future__ import annotations

from pathlib import Path

from difflm.config import PipelineConfig
from difflm.manifest import DataManifest
from difflm.models.launch.jobs import ClusterError, wait_for_job
from difflm.models.launch.kubernetes import (
    K8S_FINAL,
    get_pytorchjob,
    k8s_pytorchjob,
    mount_problem,
    pytorchjob_name,
    pytorchjob_phase,
    submit_kubernetes,
    write_kubernetes_file,
)
from difflm.models.launch.kubernetes import LAUNCH_FILE as K8S_LAUNCH_FILE
from difflm.models.launch.slurm import LAUNCH_FILE as SLURM_LAUNCH_FILE
from difflm.models.launch.slurm import (
    ROOT,
    SLURM_ACTIVE,
    SLURM_RECORD,
    sbatch_command,
    sbatch_options,
    slurm_job_state,
    slurm_script,
    submit_slurm,
    write_slurm_file,
)
from difflm.models.launch.torchrun import TRAINER

LAUNCH_FILES = {"slurm": SLURM_LAUNCH_FILE, "kubernetes": K8S_LAUNCH_FILE}

__all__ = [
    "K8S_FINAL",
    "LAUNCH_FILES",
    "ROOT",
    "SLURM_ACTIVE",
    "SLURM_RECORD",
    "ClusterError",
    "get_pytorchjob",
    "k8s_pytorchjob",
    "mount_problem",
    "pytorchjob_name",
    "pytorchjob_phase",
    "sbatch_command",
    "sbatch_options",
    "slurm_job_state",
    "slurm_script",
    "submit_kubernetes",
    "submit_slurm",
    "wait_for_job",
    "write_launch_file",
]


def write_launch_file(
    cfg: PipelineConfig, manifest: DataManifest, target: str, env: dict[str, str] | None = None, trainer: str = TRAINER
) -> Path:
    """Write the run's inputs (config.yaml, data_manifest.json) and its launch file for `target` (slurm |
    kubernetes) into the run directory; returns the launch file. What `difflm launch` writes and what the
    cluster launchers submit."""
    if target == "slurm":
        return write_slurm_file(cfg, manifest, env, trainer)
    return write_kubernetes_file(cfg, manifest, env)
