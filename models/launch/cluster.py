"""Cluster launch files for the same trainer entry point: a Slurm batch script and a Kubernetes
PyTorchJob (Kubeflow training operator). Both run `torchrun ... -m models.megatron.train` on every node with
c10d rendezvous; the config and data manifest travel as files in the run directory (shared storage).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from difflm.config import PipelineConfig

RDZV_PORT = 29500


def _train_args(config: Path, manifest: Path, run_dir: Path) -> list[str]:
    return ["-m", "models.megatron.train", "--config", str(config), "--manifest", str(manifest), "--run-dir", str(run_dir)]


def slurm_script(cfg: PipelineConfig, config: Path, manifest: Path, run_dir: Path, partition: str | None = None,
                 time: str = "24:00:00", python: str = "python") -> str:
    """An sbatch script: one torchrun per node, `train.nproc_per_node` GPUs each, `train.nnodes` nodes."""
    t = cfg.train
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=difflm-{run_dir.name[:40]}",
        f"#SBATCH --nodes={t.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={t.nproc_per_node}",
        f"#SBATCH --time={time}",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        "#SBATCH --open-mode=append",
        # preemption: 2 minutes before the time limit (or on scancel --signal=USR1 -b) the batch shell gets
        # USR1, asks the trainer to checkpoint (SIGTERM through srun and torchrun), then requeues the job,
        # which resumes from that checkpoint
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --requeue",
        *([f"#SBATCH --partition={partition}"] if partition else []),
        "set -uo pipefail",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1",
        "preempted=0",
        'trap \'preempted=1; echo "difflm: preemption signal: checkpointing"; kill -TERM "$trainer" 2>/dev/null\' USR1 TERM',
        "srun " + " ".join([
            shlex.quote(python), "-m", "torch.distributed.run",
            "--nnodes", "$SLURM_NNODES", "--nproc_per_node", str(t.nproc_per_node),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"$MASTER_ADDR:{RDZV_PORT}", "--rdzv_id", "$SLURM_JOB_ID",
            *(shlex.quote(a) for a in _train_args(config, manifest, run_dir)),
        ]) + " &",
        "trainer=$!",
        'wait "$trainer"; status=$?',
        'while kill -0 "$trainer" 2>/dev/null; do wait "$trainer"; status=$?; done  # a trap interrupts wait',
        f'if [ "$preempted" = 1 ] || [ -f {shlex.quote(str(run_dir / "preempted.json"))} ]; then',
        '  echo "difflm: requeueing job $SLURM_JOB_ID to resume from the checkpoint"; scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def k8s_pytorchjob(cfg: PipelineConfig, config: Path, manifest: Path, run_dir: Path, image: str,
                   pvc: str = "difflm-data", mount: str = "/data") -> str:
    """A Kubeflow PyTorchJob: 1 master + (nnodes - 1) workers, GPUs per pod = train.nproc_per_node."""
    t = cfg.train
    container = {
        "name": "pytorch",
        "image": image,
        "command": ["torchrun", "--nnodes", str(t.nnodes), "--nproc_per_node", str(t.nproc_per_node),
                    *_train_args(config, manifest, run_dir)],
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "resources": {"limits": {"nvidia.com/gpu": t.nproc_per_node}},
        "volumeMounts": [{"name": "data", "mountPath": mount}],
    }
    # on eviction Kubernetes sends SIGTERM and waits this long: the trainer checkpoints, and the restarted
    # pod (restartPolicy OnFailure) resumes from it
    pod = {"spec": {"containers": [container], "terminationGracePeriodSeconds": 180,
                    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": pvc}}]}}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
    if t.nnodes > 1:
        replicas["Worker"] = {"replicas": t.nnodes - 1, "restartPolicy": "OnFailure", "template": pod}
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": f"difflm-{run_dir.name[-12:]}".lower()},
        "spec": {"pytorchReplicaSpecs": replicas},
    }
    return yaml.safe_dump(job, sort_keys=False)
