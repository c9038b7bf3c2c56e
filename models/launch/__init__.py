"""Launching the trainer: local torchrun, Slurm sbatch scripts, Kubernetes PyTorchJobs.

May import `difflm.config`, `difflm.tracking.plots` and `difflm.rundir` (a run directory's layout and checkpoints) only.
"""
