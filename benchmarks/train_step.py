"""Training-step throughput and peak memory: `ar` vs `difflm-noshift`, side by side, per model preset.

    .venv/bin/python benchmarks/train_step.py [--presets tiny small] [--steps 10] [--seq 256] [--batch 8]

Each (preset, mode) runs in a fresh process (one rank, megatron-core, the same code as training:
megatron DDP + optimizer + forward-backward schedule) on random tokens, so peak memory is per case:
peak RSS on the CPU, max allocated CUDA memory on a GPU. The `ar` row is the baseline of its preset.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


class RandomTokens:
    """A stand-in for megatron's GPTDataset: random sequences, same dict layout."""

    def __init__(self, vocab: int, seq: int, n: int = 64, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(3, vocab, (n, seq + 1), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        tokens = self.data[i, :-1]
        return {"tokens": tokens, "labels": self.data[i, 1:], "loss_mask": tokens.new_ones(tokens.shape)}


def run_one(preset: str, mode: str, steps: int, seq: int, batch: int, vocab: int) -> dict:
    import torch

    from difflm.config import load_config
    from models.megatron.distributed import single_process_group
    from models.megatron.forward_step import SpecialTokens

    cfg = load_config(
        None, [f"model.preset={preset}", f"diffusion.model_running_mode={mode}", f"train.seq_length={seq}",
               f"train.micro_batch_size={batch}", f"train.global_batch_size={batch}", "train.train_iters=1000",
               "train.warmup_iters=1"])
    with single_process_group():
        from megatron.core import parallel_state, tensor_parallel

        from models.megatron import compat
        from models.megatron.train import build_training, run_global_batch

        compat.activate()
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        ddp, opt, _ = build_training(cfg, vocab)
        data = RandomTokens(vocab, seq)
        special = SpecialTokens(mask_id=1, vocab_size=vocab, special_ids=(0, 1, 2))
        params = sum(p.numel() for p in ddp.module.parameters())

        def step(i):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            loss = run_global_batch(cfg, ddp, data, special, i, i, False)
            opt.step()
            return loss

        step(0)  # warm-up: allocations, first-call overheads
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        tic = time.perf_counter()
        for i in range(1, steps + 1):
            step(i)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = (time.perf_counter() - tic) / steps
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"preset": preset, "mode": mode, "params": params, "step_s": dt, "tokens_per_s": batch * seq / dt,
            "peak_mem_mb": peak / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--modes", nargs="+", default=["ar", "difflm-noshift"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--one", nargs=2, metavar=("PRESET", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args.steps, args.seq, args.batch, args.vocab)))
        return 0
    rows = []
    for preset in args.presets:
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--one", preset, mode, "--steps", str(args.steps), "--seq",
                   str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab)]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                return out.returncode
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"  done {preset}/{mode}: {r['tokens_per_s']:,.0f} tok/s", file=sys.stderr, flush=True)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"\ntrain step, batch {args.batch} x seq {args.seq}, {args.steps} timed steps after 1 warm-up, {device}")
    print(f"{'preset':<8}{'mode':<18}{'params':>12}{'s/step':>10}{'tokens/s':>12}{'peak MB':>10}{'vs ar':>8}")
    for r in rows:
        base = next((b for b in rows if b["preset"] == r["preset"] and b["mode"] == "ar"), None)
        rel = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        print(f"{r['preset']:<8}{r['mode']:<18}{r['params']:>12,}{r['step_s']:>10.3f}{r['tokens_per_s']:>12,.0f}"
              f"{r['peak_mem_mb']:>10.0f}{rel:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
