"""Launching the trainer: local torchrun, Slurm sbatch scripts, Kubernetes PyTorchJobs.

May import `difflm.config`, `difflm.plots` and `models.megatron.checkpointing` (to find a run's checkpoints) only.
"""
