"""Megatron distributed checkpoints (torch_dist) of model, optimizer and scheduler, with resume.

Layout: <run>/checkpoints/iter_0000100/ (megatron dist_checkpointing) and <run>/checkpoints/latest
(the newest complete iteration, written only after the save finished, so an interrupted save is never
resumed from).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def latest_iteration(root: Path) -> int | None:
    marker = root / "latest"
    if not marker.exists():
        return None
    it = int(marker.read_text().strip())
    return it if iter_dir(root, it).exists() else None


def _model_sharded(model) -> dict:
    return model.sharded_state_dict(prefix="")


def save_checkpoint(root: Path, iteration: int, model, optimizer, scheduler, keep_last: int) -> Path:
    from megatron.core import dist_checkpointing

    path = iter_dir(root, iteration)
    rank = torch.distributed.get_rank()
    if rank == 0:
        if path.exists():  # leftovers of an interrupted save of the same iteration
            shutil.rmtree(path)
        path.mkdir(parents=True)
    torch.distributed.barrier()
    model_sd = _model_sharded(model)
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
    }
    dist_checkpointing.save(state, str(path))
    torch.distributed.barrier()
    if rank == 0:
        tmp = root / "latest.part"
        tmp.write_text(str(iteration))
        tmp.replace(root / "latest")
        _prune(root, keep_last, keep=iteration)
    torch.distributed.barrier()
    return path


def _prune(root: Path, keep_last: int, keep: int) -> None:
    dirs = sorted(p for p in root.glob("iter_*") if p.is_dir())
    for p in dirs[:-keep_last]:
        if p != iter_dir(root, keep):
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(root: Path, iteration: int, model, optimizer=None, scheduler=None) -> int:
    """Load model (and optimizer/scheduler when given) in place; returns the iteration."""
    from megatron.core import dist_checkpointing

    path = iter_dir(root, iteration)
    model_sd = _model_sharded(model)
    sharded = {"model": model_sd}
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True)
    state = dist_checkpointing.load(sharded, str(path))
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    return int(state.get("iteration", iteration))
