"""Parallel-layout parity check, run under torchrun: the same weights and batch must give the same
loss whatever the tensor/pipeline/data-parallel layout.

    # reference (one process) saves its initial weights, then any layout loads and compares:
    python -m torch.distributed.run --nproc_per_node 1 -m difflm.models.megatron.parity --config C --manifest M --weights W --save --out ref.json
    python -m torch.distributed.run --nproc_per_node 2 -m difflm.models.megatron.parity --config C --manifest M --weights W --out tp2.json \\
        parallel.tensor_model_parallel_size=2

Two optimizer steps are taken, so the check covers gradients and the optimizer as well as the forward; the
parameters every TP rank replicates must stay identical across TP ranks (`replica_spread`).

`--runs R.json` runs several layouts of the same world size in one torchrun, one after the other (a list of
{"out": ..., "overrides": [...], "save": false}): the model-parallel groups are rebuilt between them, and the
process start (torch and megatron imports, about 10 s a process) is paid once. A run may name its own "config"
and "weights" (default: --config and --weights), so one torchrun checks the layouts of several models.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state

from difflm.config import load_config
from difflm.manifest import DataManifest
from difflm.models.diffusion.modes import build_objective
from difflm.models.megatron.data import build_datasets
from difflm.models.megatron.forward_step import SpecialTokens
from difflm.models.megatron.safe_pickle import guard_dcp
from difflm.models.megatron.train import build_training, init_distributed, init_model_parallel, run_global_batch


def replica_spread(model) -> float:
    """Largest difference, across tensor-parallel ranks, of the parameters every TP rank holds a full copy of
    (norms, time embedding): 0 when their gradients are reduced correctly, > 0 once they drift."""
    group = parallel_state.get_tensor_model_parallel_group()
    replicated = [
        p.detach().float().flatten() for p in model.parameters() if not getattr(p, "tensor_model_parallel", False)
    ]
    if not replicated or dist.get_world_size(group) == 1:
        return 0.0
    hi = torch.cat(replicated)
    lo = hi.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return float((hi - lo).max())


def reinit_model_parallel(cfg) -> None:
    """The next run's tensor/pipeline groups in a process whose previous run had others (init_distributed's
    second half: the process group stays)."""
    parallel_state.destroy_model_parallel()
    init_model_parallel(cfg)


def run_layout(cfg, manifest: DataManifest, weights: Path, save: bool, steps: int) -> dict | None:
    """Two optimizer steps of `cfg`'s layout from the saved weights (saving them first with `save`); the losses and
    the replica spread on the reporting rank, None on the others."""
    special = SpecialTokens.from_manifest(manifest.tokenizer)
    objective = build_objective(cfg.diffusion, special.ids())  # once per layout, as the trainer builds it
    train_ds, _ = build_datasets(cfg, manifest, steps * cfg.train.global_batch_size, cfg.train.global_batch_size)
    ddp, opt, sched = build_training(cfg, manifest.tokenizer.vocab_size, objective=objective)
    sched.step(increment=cfg.train.schedule.warmup_iters)  # start at the peak rate: warmup's first lr is 0, no update
    if save:
        if dist.get_rank() == 0:
            weights.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(ddp.module.sharded_state_dict(prefix=""), str(weights))
    else:
        guard_dcp()
        state = dist_checkpointing.load(ddp.module.sharded_state_dict(prefix=""), str(weights))
        ddp.module.load_state_dict(state)
    losses = []
    for step in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses.append(run_global_batch(cfg, ddp, train_ds, special, step=step, noise_step=step, objective=objective))
        opt.step()
    spread = replica_spread(ddp.module)
    reporting = (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    return {"losses": losses, "replica_spread": spread} if reporting else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="the config file (required unless every run of --runs names its own)")
    p.add_argument("--manifest", required=True)
    p.add_argument("--weights", help="model-only dist checkpoint folder (as --config: a run may name its own)")
    p.add_argument("--save", action="store_true", help="save this run's initial weights to --weights first")
    p.add_argument("--out", help="JSON file for the losses (written by the reporting rank)")
    p.add_argument("--runs", help="JSON list of runs ({out, overrides, save}) in this process, instead of --out")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("overrides", nargs="*", help="config overrides of every run")
    args = p.parse_args(argv)
    if bool(args.out) == bool(args.runs):
        p.error("give --out (one run) or --runs (several)")
    runs = json.loads(Path(args.runs).read_text()) if args.runs else [{"out": args.out, "save": args.save}]
    for key in ("config", "weights"):
        if getattr(args, key) is None and any(key not in spec for spec in runs):
            p.error(f"give --{key}, or a {key!r} in every run of --runs")

    world = int(os.environ.get("WORLD_SIZE", 1))
    manifest = DataManifest.read(args.manifest)
    for i, spec in enumerate(runs):
        overrides = [*args.overrides, *spec.get("overrides", []), f"train.launch.nproc_per_node={world}"]
        cfg = load_config(spec.get("config", args.config), overrides)
        if i == 0:
            init_distributed(cfg)
        else:
            reinit_model_parallel(cfg)
        weights = Path(spec.get("weights", args.weights))
        result = run_layout(cfg, manifest, weights, bool(spec.get("save")), args.steps)
        if result is not None:
            Path(spec["out"]).write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # dist_checkpointing spawns helpers: the guard is required
    sys.exit(main())
