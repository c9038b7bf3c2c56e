"""Launching the trainer: local torchrun, Slurm sbatch scripts, Kubernetes PyTorchJobs.

May import `difflm.config` and `models.megatron.checkpointing` (to find a run's checkpoints) only.
"""
