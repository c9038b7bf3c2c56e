"""Faults the tests inject into a real training run, from the test side: the production loop has no test hook.

`FaultInjector` is a trainer hook (models/megatron/train.py `Hook`). For a torchrun run, this module is the
entry point the ranks run instead of `difflm.models.megatron.train`: it installs the injector and calls the trainer's
own `main`. Use `fault_launch` to get the `launch_training` arguments that do so:

    launch_training(cfg, manifest, **fault_launch(nan_iters={6}))

Why an entry module rather than a `--hook module:factory` trainer option: the production trainer then has no
way to load code by name, and the launcher only learns which module torchrun runs (`trainer=`).
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

from difflm.models.megatron import checkpointing
from difflm.models.megatron.hooks import Hook, Step
from difflm.models.megatron.train import Trainer, main

NAN_ITERS = "FAULT_NAN_ITERS"  # read only by this entry module, in the ranks it starts
DISK_FULL_AT = "FAULT_DISK_FULL_AT"  # the checkpoint save at this iteration fails: no space left on the device
STEP_SLEEP = "FAULT_STEP_SLEEP"  # seconds of sleep before each step of a run that starts from iteration 0


class FaultInjector(Hook):
    """At the given iterations, a NaN loss and NaN gradients on every rank, after the backward pass and before
    the NonFiniteGuard looks (hooks passed to the trainer run before the standard ones)."""

    def __init__(self, nan_iters: set[int]):
        self.nan_iters = set(nan_iters)

    def pre_optim_step(self, trainer: Trainer, step: Step) -> None:
        if step.it not in self.nan_iters:
            return
        if step.loss_terms is not None:  # this rank's [sum, count], before the ranks agree (last stage only)
            step.loss_terms[0] = float("nan")
        for buf in getattr(trainer.ddp, "buffers", []):  # megatron DDP's contiguous gradient buffers
            buf.grad_data.fill_(float("nan"))


class SlowFirstAttempt(Hook):
    """A run that starts from scratch sleeps before each step, so that a signal (a Slurm time limit) finds it
    training; a resumed run goes at full speed. Sleeping changes no number: the weights are those of any run."""

    def __init__(self, seconds: float):
        self.seconds, self.active = seconds, False

    def on_start(self, trainer: Trainer) -> None:
        self.active = trainer.start == 0

    def pre_step(self, trainer: Trainer, done: int) -> None:
        if self.active:
            time.sleep(self.seconds)


def fault_launch(
    nan_iters: set[int] = frozenset(), disk_full_at: int | None = None, step_sleep: float | None = None
) -> dict:
    """`launch_training` (or `submit_slurm`) keyword arguments that run this module, with its hooks, on every
    rank."""
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    env = {NAN_ITERS: ",".join(str(i) for i in sorted(nan_iters)), "PYTHONPATH": path}
    if disk_full_at is not None:
        env[DISK_FULL_AT] = str(disk_full_at)
    if step_sleep is not None:
        env[STEP_SLEEP] = str(step_sleep)
    return {"trainer": Path(__file__).stem, "env": env}


def _fill_disk_at(iteration: int) -> None:
    """The save at `iteration` writes part of its folder, then fails as a full disk does."""
    real = checkpointing.save_checkpoint

    def save_checkpoint(root, it, *args, **kwargs):
        if it != iteration:
            return real(root, it, *args, **kwargs)
        checkpointing.iter_dir(root, it).mkdir(parents=True, exist_ok=True)
        (checkpointing.iter_dir(root, it) / "__0_0.distcp").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(checkpointing.iter_dir(root, it)))

    checkpointing.save_checkpoint = save_checkpoint


if __name__ == "__main__":  # dist_checkpointing spawns helpers: the guard is required
    if os.environ.get(DISK_FULL_AT):
        _fill_disk_at(int(os.environ[DISK_FULL_AT]))
    iters = {int(x) for x in os.environ.get(NAN_ITERS, "").split(",") if x.strip()}
    hooks = [FaultInjector(iters)]
    if os.environ.get(STEP_SLEEP):
        hooks.append(SlowFirstAttempt(float(os.environ[STEP_SLEEP])))
    sys.exit(main(hooks=hooks))
