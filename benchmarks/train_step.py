"""Training-step throughput, FLOP/s, MFU and peak memory: `ar` vs `difflm-noshift`, side by side, per preset.

    .venv/bin/python benchmarks/train_step.py [--presets tiny small] [--steps 10] [--seq 256] [--batch 8]

Each (preset, mode) runs in a fresh process (one rank, megatron-core, the same code as training:
megatron DDP + optimizer + forward-backward schedule and the trainer's forward step, which puts every
batch tensor on the model's device) on random tokens, so peak memory is per case: max allocated CUDA
memory on a GPU, peak RSS on the CPU. The `ar` row is the baseline of its preset: `t/t_ar` is the step
time over ar's at the same batch x seq. Model FLOPs come from models/megatron/flops.py (3x the forward,
causal attention counted as half of s x s); MFU is given against the device's peak dense bf16 FLOP/s
when the device is known (a GPU in flops.PEAK_BF16_FLOPS, or --peak-tflops), '-' otherwise (the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
from megatron.core import parallel_state, tensor_parallel

from difflm.config import load_config
from difflm.models.diffusion.modes import build_objective, objective_class
from difflm.models.megatron import compat
from difflm.models.megatron.backend import resolve_backend
from difflm.models.megatron.distributed import single_process_group
from difflm.models.megatron.flops import efficiency, peak_flops, training_flops
from difflm.models.megatron.forward_step import SpecialTokens
from difflm.models.megatron.train import build_training, micro_lengths, run_global_batch


class RandomTokens:
    """A stand-in for megatron's GPTDataset: random sequences, same dict layout, on the CPU as GPTDataset's
    are (the trainer's forward step moves each micro-batch to the model's device after corrupting it)."""

    def __init__(self, vocab: int, seq: int, n: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(3, vocab, (n, seq + 1), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        tokens = self.data[i, :-1]
        return {"tokens": tokens, "labels": self.data[i, 1:], "loss_mask": tokens.new_ones(tokens.shape)}


def bench_config(preset: str, mode: str, args: argparse.Namespace):
    seq, batch = args.seq, args.batch
    return load_config(
        None,
        [
            f"model.preset={preset}",
            f"model.backend={args.backend}",
            f"diffusion.model_running_mode={mode}",
            f"train.seq_length={seq}",
            f"train.micro_batch_size={batch}",
            f"train.global_batch_size={batch}",
            f"train.precision={args.precision}",
            "train.train_iters=1000",
            "train.schedule.warmup_iters=1",
            *([f"train.peak_tflops={args.peak_tflops}"] if args.peak_tflops else []),
            *args.override,
        ],
    )


def run_one(preset: str, mode: str, args: argparse.Namespace) -> dict:
    cfg, vocab = bench_config(preset, mode, args), args.vocab
    special = SpecialTokens(mask_id=1, vocab_size=vocab, special_ids=(0, 1, 2))
    objective = build_objective(cfg.diffusion, special.ids())  # once, as the trainer builds it
    with single_process_group():
        compat.activate()
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        ddp, opt, _ = build_training(cfg, vocab, objective=objective)
        data = RandomTokens(vocab, args.seq)
        params = sum(p.numel() for p in ddp.module.parameters())
        n_micro = cfg.train.global_batch_size // cfg.train.micro_batch_size

        def step(i) -> list[int]:
            lengths = micro_lengths(cfg, i, n_micro, objective=objective)  # the trainer's: full windows unless varilen
            ddp.zero_grad_buffer()
            opt.zero_grad()
            run_global_batch(cfg, ddp, data, special, step=i, noise_step=i, lengths=lengths, objective=objective)
            opt.step()
            return lengths

        step(0)  # warm-up: allocations, first-call overheads
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        tic = time.perf_counter()
        lengths = [step(i) for i in range(1, args.steps + 1)]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - tic
    mbs = cfg.train.micro_batch_size
    flops = sum(training_flops(cfg, vocab, ls, mbs, objective=objective) for ls in lengths)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    eff = efficiency(flops, elapsed, 1, peak_flops(device, cfg.train.peak_tflops))
    peak = (
        torch.cuda.max_memory_allocated()
        if torch.cuda.is_available()
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "preset": preset,
        "mode": mode,
        "backend": resolve_backend(cfg.model.backend),
        "params": params,
        "step_s": elapsed / args.steps,
        "tokens_per_s": sum(map(sum, lengths)) * mbs / elapsed,
        "flops_per_step": flops / args.steps,
        **eff,
        "peak_mem_mb": peak / 2**20,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--presets",
        nargs="+",
        default=["tiny", "small"],
        help="model presets (difflm/config/model.py MODEL_PRESETS: tiny small 70m 125m 250m 350m 1b 3b 7b); default: tiny small",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=["ar", "difflm-noshift"],
        help="diffusion.model_running_mode values to compare; default: ar difflm-noshift",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps, after one untimed warm-up step; default: 10")
    p.add_argument("--seq", type=int, default=256, help="train.seq_length; default: 256")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (one micro-batch); default: 8")
    p.add_argument(
        "--vocab", type=int, default=4096, help="vocabulary size (padded as megatron pads it); default: 4096"
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default=None,
        help="train.precision; default: bf16 on a GPU (what MFU's peak refers to), fp32 on the CPU",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "torch", "local", "te"],
        default="auto",
        help="model.backend (layer spec); default: auto (te with Transformer Engine, else torch)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak dense bf16 TFLOP/s of the device for "
        "MFU (train.peak_tflops); default: looked up by device name, none on the CPU",
    )
    p.add_argument(
        "--override",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="further config overrides for every case, e.g. diffusion.varilen_prob=0.01 (then "
        "difflm trains on shorter windows and t/t_ar is no longer at equal shape)",
    )
    p.add_argument("--one", nargs=2, metavar=("PRESET", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.precision is None:
        args.precision = "bf16" if torch.cuda.is_available() else "fp32"
    return args


def case_command(preset: str, mode: str, args: argparse.Namespace) -> list[str]:
    """This script with --one for one (preset, mode), the other options passed on as given."""
    cmd = [
        sys.executable,
        __file__,
        "--one",
        preset,
        mode,
        "--steps",
        str(args.steps),
        "--seq",
        str(args.seq),
        "--batch",
        str(args.batch),
        "--vocab",
        str(args.vocab),
        "--precision",
        args.precision,
        "--backend",
        args.backend,
    ]
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    return cmd + (["--override", *args.override] if args.override else [])


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    memory = "max allocated CUDA" if torch.cuda.is_available() else "peak RSS"
    print(
        f"\ntrain step, batch {args.batch} x seq {args.seq}, {args.precision}, {args.steps} timed steps after "
        f"1 warm-up, {device}; peak MB: {memory}"
    )
    print(
        f"{'preset':<8}{'mode':<18}{'backend':<8}{'params':>12}{'s/step':>10}{'tokens/s':>12}{'TFLOP/s':>9}"
        f"{'MFU':>7}{'peak MB':>10}{'t/t_ar':>8}"
    )
    for r in rows:
        base = next(
            (b for b in rows if b["preset"] == r["preset"] and not objective_class(b["mode"]).bidirectional), None
        )  # the causal (ar) baseline of the same preset
        rel = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(
            f"{r['preset']:<8}{r['mode']:<18}{r['backend']:<8}{r['params']:>12,}{r['step_s']:>10.3f}"
            f"{r['tokens_per_s']:>12,.0f}{r['tflops_per_device']:>9.3g}{mfu:>7}{r['peak_mem_mb']:>10.0f}{rel:>8}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_one(*args.one, args)))
        return 0
    rows = []
    for preset in args.presets:
        for mode in args.modes:
            out = subprocess.run(
                case_command(preset, mode, args),
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                return out.returncode
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(
                f"  done {preset}/{mode}: {r['tokens_per_s']:,.0f} tok/s, {r['tflops_per_device']:.3g} TFLOP/s",
                file=sys.stderr,
                flush=True,
            )
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
