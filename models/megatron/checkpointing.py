"""Megatron distributed checkpoints (torch_dist) of model, optimizer and scheduler, with resume.

Layout: <run>/checkpoints/iter_0000100/ (megatron dist_checkpointing, plus rng/rank00000.pt: each rank's
RNG states, so dropout draws the same masks after a resume) and <run>/checkpoints/latest (the newest
complete iteration, written only after the save finished, so an interrupted save is never resumed from).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

from difflm.models.megatron.safe_pickle import check_common, guard_dcp

# the run layout's owner (reading which checkpoint is complete needs no megatron); re-exported for callers here
from difflm.rundir import LATEST, iter_dir, latest_iteration  # noqa: F401

# The distributed optimizer's default sharding type cannot be saved on this stack
# ("flattened_range is not supported"); dp_reshardable can, and reloads at another DP size.
_OPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _model_sharded(model) -> dict:
    return model.sharded_state_dict(prefix="")


def save_checkpoint(root: Path, iteration: int, model, optimizer, scheduler, keep_last: int) -> Path:
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
        "optimizer": optimizer.sharded_state_dict(model_sd, metadata=_OPT_METADATA),
        "scheduler": scheduler.state_dict(),
        "iteration": iteration,
    }
    dist_checkpointing.save(state, str(path))
    (path / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), _rng_file(path))
    torch.distributed.barrier()
    if rank == 0:
        tmp = root / f"{LATEST}.part"
        tmp.write_text(str(iteration))
        tmp.replace(root / LATEST)
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
    guard_dcp()
    path = iter_dir(root, iteration)
    check_common(path)
    model_sd = _model_sharded(model)
    sharded = {"model": model_sd}
    if optimizer is not None:
        _init_adam_state(optimizer)  # the distributed optimizer cannot describe its state before it exists
        sharded["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=_OPT_METADATA)
    state = dist_checkpointing.load(sharded, str(path))
    model.load_state_dict(state["model"])
    iteration = int(state.get("iteration", iteration))
    if optimizer is not None:
        with torch.no_grad():  # fp32 main params are leaves: loading into them needs no_grad
            optimizer.load_state_dict(state["optimizer"])
        _restore_adam_steps(optimizer, iteration)
    if scheduler is not None and "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    if optimizer is not None:  # a resume (not an init): continue the random streams too
        _restore_rng(path)
    return iteration


def _layout() -> dict:
    return {
        "world": torch.distributed.get_world_size(),
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
    }


def _rng_file(path: Path) -> Path:
    return Path(path) / "rng" / f"rank{torch.distributed.get_rank():05d}.pt"


def _rng_state() -> dict:
    """This rank's random streams: torch's default generator (hidden dropout), megatron's RNG tracker
    (attention dropout, per TP rank) and CUDA's."""
    state = {
        "layout": _layout(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(path: Path) -> None:
    file = _rng_file(path)
    if not file.exists():
        return  # a checkpoint from before RNG states were saved: dropout masks differ from an unbroken run
    state = torch.load(file, weights_only=True)  # tensors and plain containers: a crafted file runs nothing
    if state["layout"] != _layout():
        if torch.distributed.get_rank() == 0:
            print(
                f"[train] resuming at another parallel layout ({state['layout']} -> {_layout()}): dropout "
                "masks will differ from an uninterrupted run",
                flush=True,
            )
        return
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_model_weights(path: Path, model) -> None:
    """Initialise `model` from a model-only (or full) dist checkpoint; resharded to this TP/PP layout."""
    if not (Path(path) / "metadata.json").exists():
        raise FileNotFoundError(f"train.init_from={path}: not a megatron distributed checkpoint")
    guard_dcp()
    check_common(path)
    sharded = model.sharded_state_dict(prefix="")
    full = dist_checkpointing.load_tensors_metadata(str(path))
    if not any(k.startswith("optimizer.") for k in full):  # a model-only checkpoint: keys at the top level
        model.load_state_dict(dist_checkpointing.load(sharded, str(path)))
        return
    model.load_state_dict(dist_checkpointing.load({"model": sharded}, str(path))["model"])


def _torch_optimizers(optimizer) -> list:
    inner = optimizer.chained_optimizers if hasattr(optimizer, "chained_optimizers") else [optimizer]
    return [getattr(opt, "optimizer", opt) for opt in inner]


def _init_adam_state(optimizer) -> None:
    """Zero Adam state for parameters that have none yet (overwritten by the load that follows)."""
    for torch_opt in _torch_optimizers(optimizer):
        for group in torch_opt.param_groups:
            for p in group["params"]:
                if p not in torch_opt.state or not torch_opt.state[p]:
                    torch_opt.state[p] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }


def _restore_adam_steps(optimizer, iteration: int) -> None:
    """Give every parameter its own Adam step count equal to the iteration.

    After a reload, megatron's torch-Adam fallback can leave all parameters sharing ONE `step` tensor
    (holding a placeholder), which silently corrupts Adam's bias correction; in fp32 no step is ever
    skipped, so the true count is the iteration.
    """
    for torch_opt in _torch_optimizers(optimizer):
        for state in torch_opt.state.values():
            if "step" in state:
                state["step"] = torch.tensor(float(iteration))
