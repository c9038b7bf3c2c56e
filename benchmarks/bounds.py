"""Likelihood of each model family trained on the same data, side by side: masked diffusion (MDLM/LLaDA
ELBO), uniform-state diffusion (UDLM continuous-time ELBO), block diffusion (BD3-LM block ELBO) and the
autoregressive baseline (exact NLL).

    .venv/bin/python benchmarks/bounds.py [--preset tiny-cpu] [--iters 1200] [--modes difflm-noshift ...]

Every family gets the same data, model size, optimiser and number of steps (the preset), and is scored
by the pipeline's own evaluation on the same held-out windows and the same tokens (1..L-1 of each window,
given token 0), next to an untrained model of the same architecture. Runs are content-addressed in the
workdir: a rerun with the same settings reuses finished training and only evaluates again.
"""

from __future__ import annotations

import argparse
import os
import time

from difflm.config import load_config
from difflm.data_prep.pipeline import prepare_data
from difflm.models.evaluation.stages import convert_checkpoint, evaluate_export
from difflm.models.launch.torchrun import launch_training

MODES = {  # mode: (what it is, extra overrides)
    "difflm-noshift": ("masked diffusion: LLaDA/MDLM discrete ELBO", []),
    "difflm-noshift-uniform": ("uniform diffusion: UDLM continuous-time ELBO", ["diffusion.time_embedding=true"]),
    "difflm-block": ("block diffusion (blocks of 4): BD3-LM block ELBO", ["diffusion.block_size=4"]),
    "ar": ("autoregressive baseline: exact NLL", []),
}


def run(mode: str, preset: str, iters: int | None, workdir: str) -> dict:
    overrides = [f"workdir={workdir}", f"diffusion.model_running_mode={mode}", *MODES[mode][1]]
    if iters:
        overrides.append(f"train.train_iters={iters}")
    cfg = load_config(preset, overrides)
    manifest = prepare_data(cfg)
    tic = time.time()
    info = launch_training(cfg, manifest, echo=lambda line: print(f"  [{mode}] {line}", flush=True))
    trained_s = time.time() - tic
    results = evaluate_export(cfg, manifest, convert_checkpoint(cfg, manifest, info).folder)
    return {
        "mode": mode,
        "what": MODES[mode][0],
        "reused": info.reused,
        "train_s": trained_s,
        "iters": cfg.train.train_iters,
        **results.bounds,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| mode | family, bound | steps | untrained nats/token | trained nats/token | trained ppl (bound) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, u = r["trained"], r["untrained"]
        lines.append(
            f"| {r['mode']} | {r['what']} | {r['iters']} | {u['nll_per_token']:.3f} | "
            f"**{t['nll_per_token']:.3f}** | {t['ppl']:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-cpu")
    p.add_argument("--iters", type=int, default=None, help="train.train_iters (default: the preset's)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--workdir", default=".difflm")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = []
    for mode in args.modes:
        print(f"== {mode}", flush=True)
        rows.append(run(mode, args.preset, args.iters, args.workdir))
    tokens = rows[0]["trained"]["tokens"]
    print(f"\nheld-out: {rows[0]['trained']['sequences']} windows, {tokens:,} scored tokens (1..L-1 given token 0)")
    print(table(rows))


if __name__ == "__main__":  # dist_checkpointing spawns helpers: the guard is required
    main()
