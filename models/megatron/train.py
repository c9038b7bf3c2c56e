"""Training entry point, run under torchrun: `python -m torch.distributed.run ... -m models.megatron.train`.

One process per rank (gloo on CPU, NCCL on GPU); megatron-core's parallel state, DDP, optimizer and
forward-backward schedules do the parallel work. Writes megatron distributed checkpoints and
metrics.jsonl; resumes from the latest complete checkpoint of its run directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from difflm.config import PipelineConfig, load_config
from difflm.rundir import RunDir
from models.megatron import checkpointing
from models.megatron.data import build_datasets, micro_batch
from models.megatron.flops import efficiency, peak_flops, training_flops
from models.megatron.gpt import build_model
from models.megatron.metrics import MetricsWriter
from models.megatron.forward_step import SpecialTokens, make_forward_step, varilen_length


def init_distributed(cfg: PipelineConfig) -> None:
    from megatron.core import parallel_state, tensor_parallel

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    from models.megatron import compat

    compat.activate()  # no-op with CUDA
    threads = cfg.train.torch_threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    torch.set_num_threads(threads)
    parallel_state.initialize_model_parallel(
        cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    )
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)


def build_training(cfg: PipelineConfig, vocab_size: int):
    """(ddp_model, optimizer, scheduler) for this rank's pipeline stage."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model = build_model(
        cfg,
        vocab_size,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    if torch.cuda.is_available():
        model.cuda()
    if cfg.train.precision == "bf16":  # every parameter bf16 (torch norms, time embedding too), fp32 outputs;
        from megatron.core.transformer.module import Float16Module  # the optimizer keeps fp32 main weights

        model = Float16Module(model.config, model)
    dist_opt = cfg.parallel.use_distributed_optimizer
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt),
        module=model,
    )
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    t = cfg.train
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, clip_grad=t.clip_grad,
            bf16=t.precision == "bf16", fp16=False,
            use_distributed_optimizer=dist_opt,
        ),
        [ddp],
    )
    sched = OptimizerParamScheduler(opt, **scheduler_kwargs(cfg))
    return ddp, opt, sched


def scheduler_kwargs(cfg: PipelineConfig) -> dict:
    """megatron OptimizerParamScheduler arguments for train.lr_schedule (warmup, then the schedule)."""
    t = cfg.train
    style = {"cosine": "cosine", "linear": "linear", "constant": "constant", "wsd": "WSD"}[t.lr_schedule]
    extra = {}
    if style == "WSD":  # the decay phase takes the last fraction, never the warmup
        decay = max(1, min(round(t.wsd_decay_fraction * t.train_iters), t.train_iters - t.warmup_iters))
        extra = {"wsd_decay_steps": decay, "lr_wsd_decay_style": t.wsd_decay_style}
    return dict(init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.warmup_iters,
                lr_decay_steps=t.train_iters, lr_decay_style=style, start_wd=t.weight_decay, end_wd=t.weight_decay,
                wd_incr_steps=t.train_iters, wd_incr_style="constant", **extra)


class IntervalMeter:
    """What one log line reports: the mean loss over the logging interval (not one step's), the tokens really
    processed per second (variable-length steps count their true lengths), and the model FLOPs of those
    tokens (attention included, from the config: models/megatron/flops.py) as TFLOP/s and MFU per device."""

    def __init__(self, now: float, n_devices: int = 1, peak: float | None = None):
        self.n_devices, self.peak = n_devices, peak
        self.restart(now)

    def restart(self, now: float) -> None:
        self.tic, self.tokens, self.flops, self.losses = now, 0, 0.0, []

    def add(self, loss: float | None, tokens: int, flops: float = 0.0) -> None:
        self.tokens += tokens
        self.flops += flops
        if loss is not None:  # only the last pipeline stage has the loss
            self.losses.append(loss)

    def report(self, now: float) -> tuple[float | None, float]:
        mean = sum(self.losses) / len(self.losses) if self.losses else None
        return mean, self.tokens / max(now - self.tic, 1e-9)

    def efficiency(self, now: float) -> dict:
        """tokens_per_s_per_device, tflops_per_device, mfu (None without a known device peak)."""
        seconds = max(now - self.tic, 1e-9)
        return {"tokens_per_s_per_device": self.tokens / seconds / self.n_devices,
                **efficiency(self.flops, seconds, self.n_devices, self.peak)}


def device_peak(cfg: PipelineConfig) -> float | None:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return peak_flops(name, cfg.train.peak_tflops)


def peak_memory_gb() -> float | None:
    """The most GPU memory this rank's tensors have held (None on the CPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def micro_lengths(cfg: PipelineConfig, step: int, n_micro: int) -> list[int]:
    """Sequence length of each micro-batch of training step `step` (variable-length training).

    One draw per micro-batch, as MegaDLMs, for diffusion modes only (the AR baseline always sees full
    windows). Pipeline stages exchange fixed-shape activations, so with PP > 1 the step's micro-batches
    share one length. Keyed by (seed, step, micro): the same on every rank and on resume."""
    t, d = cfg.train, cfg.diffusion
    if d.varilen_prob <= 0 or d.model_running_mode == "ar":
        return [t.seq_length] * n_micro
    one = cfg.parallel.pipeline_model_parallel_size > 1
    return [varilen_length(t.seed, step, t.seq_length, d.varilen_prob, cfg.parallel.tensor_model_parallel_size,
                           0 if one else m) for m in range(n_micro)]


def run_global_batch(cfg, ddp, dataset, special: SpecialTokens, step: int, noise_step: int,
                     forward_only: bool, lengths: list[int] | None = None) -> float | None:
    """One global batch through megatron's forward-backward schedule; its loss on the last stage.

    `step` picks the data, `noise_step` keys the noise (evaluation uses fixed negative keys so that
    successive evaluations are comparable), `lengths` truncates each micro-batch (variable-length
    training). The loss is sum / count over the whole global batch (every micro-batch and DP rank).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    n_micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp_size)
    lengths = lengths or [cfg.train.seq_length] * n_micro
    batches = iter([micro_batch(dataset, step, m, dp_rank, cfg, dp_size, lengths[m]) for m in range(n_micro)])
    losses = get_forward_backward_func()(
        forward_step_func=make_forward_step(cfg, special, noise_step, evaluation=forward_only),
        data_iterator=batches,
        model=[ddp],
        num_microbatches=n_micro,
        seq_length=max(lengths),
        micro_batch_size=cfg.train.micro_batch_size,
        forward_only=forward_only,
    )
    if not parallel_state.is_pipeline_last_stage():
        return None
    total = torch.stack([x["loss"] for x in losses]).sum(0)  # [sum, count] of this rank
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return float(total[0] / total[1].clamp(min=1))


def evaluate(cfg, ddp, valid, special: SpecialTokens) -> float | None:
    ddp.eval()
    with torch.no_grad():
        vals = [run_global_batch(cfg, ddp, valid, special, i, -1 - i, True) for i in range(cfg.train.eval_iters)]
    ddp.train()
    return None if vals[0] is None else sum(vals) / len(vals)


class PreemptionFlag:
    """Set by the configured signals; the step in flight finishes, then every rank agrees to stop."""

    def __init__(self, names: list[str]):
        self.signal: str | None = None
        sigs = [getattr(signal, name) for name in names]
        _start_checkpoint_writer_immune(sigs)
        for sig in sigs:
            signal.signal(sig, self._handler)

    def _handler(self, signum, _frame) -> None:
        self.signal = signal.Signals(signum).name

    def agreed(self) -> bool:
        """True on every rank when any rank got a signal (one all-reduce of one number per step)."""
        flag = torch.tensor([1.0 if self.signal else 0.0], device=_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _start_checkpoint_writer_immune(sigs: list) -> None:
    """torchrun signals a rank's whole process group, which includes the helper process megatron's
    checkpoint writer spawns on its first save: started while the signals are ignored (a disposition a spawned
    interpreter inherits), it outlives the signal and the checkpoint written on it completes."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    start = getattr(filesystem_async, "_get_write_results_queue", None)
    if start is None:  # another megatron version: nothing to prepare
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        start()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def injected_faults() -> set[int]:
    """Iterations at which a test injects a non-finite loss and gradients (DIFFLM_FAULT_NAN_ITERS=3,7)."""
    raw = os.environ.get("DIFFLM_FAULT_NAN_ITERS", "")
    return {int(x) for x in raw.split(",") if x.strip()}


def grads_finite(ddp, loss: float | None, poison: bool) -> bool:
    """True on every rank when the loss (last stage) and every gradient buffer are finite."""
    bad = loss is not None and not math.isfinite(loss)
    for buf in getattr(ddp, "buffers", []):  # megatron DDP: contiguous gradient buffers, one check each
        if poison:
            buf.grad_data.fill_(float("nan"))
        bad = bad or not bool(torch.isfinite(buf.grad_data).all())
    flag = torch.tensor([1.0 if bad else 0.0], device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return not flag.item()


def train(cfg: PipelineConfig, manifest: dict, run_dir: Path) -> None:
    from megatron.core import parallel_state

    init_distributed(cfg)
    tok = manifest["tokenizer"]
    special = SpecialTokens.from_manifest(tok)
    t = cfg.train
    train_ds, valid_ds = build_datasets(
        cfg, manifest, t.train_iters * t.global_batch_size, (t.eval_iters + 1) * t.global_batch_size
    )
    ddp, opt, sched = build_training(cfg, tok["vocab_size"])
    run = RunDir(run_dir)  # the layout: checkpoints/, metrics.jsonl, preempted.json / stopped.json
    ckpt_root = run.checkpoints
    start = 0
    latest = checkpointing.latest_iteration(ckpt_root)
    if latest is not None:
        start = checkpointing.load_checkpoint(ckpt_root, latest, ddp.module, opt, sched)
    elif t.init_from:
        checkpointing.load_model_weights(Path(t.init_from), ddp.module)
    reporting = (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    log = (lambda msg: print(msg, flush=True)) if reporting else (lambda msg: None)
    metrics = MetricsWriter(run.metrics_file, reporting, os.environ.get("DIFFLM_MLFLOW_RUN_ID"), log)
    for marker in run.markers:
        marker.unlink(missing_ok=True)
    preempt = PreemptionFlag(t.preempt_signals)
    poison = injected_faults()
    skipped_in_a_row = skipped_total = 0
    log(f"[train] mode={cfg.diffusion.model_running_mode} start_iter={start} train_iters={t.train_iters} "
        f"params/rank={sum(p.numel() for p in ddp.module.parameters()):,}")
    if start == 0:
        metrics.log(0, val_loss=evaluate(cfg, ddp, valid_ds, special))
    dp_size = parallel_state.get_data_parallel_world_size()
    n_micro = t.global_batch_size // (t.micro_batch_size * dp_size)
    meter = IntervalMeter(time.time(), dist.get_world_size(), device_peak(cfg))
    for step in range(start, t.train_iters):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        lengths = micro_lengths(cfg, step, n_micro)
        loss = run_global_batch(cfg, ddp, train_ds, special, step, step, False, lengths)
        it = step + 1
        if it in poison and loss is not None:
            loss = float("nan")
        if not grads_finite(ddp, loss, it in poison):
            skipped_in_a_row += 1
            skipped_total += 1
            metrics.log(it, nonfinite_skipped=skipped_total)
            if t.on_nonfinite == "stop" or skipped_in_a_row > t.max_nonfinite_skips:
                _stop_nonfinite(cfg, run_dir, ckpt_root, it, skipped_in_a_row, log, metrics)
            log(f"[train] iter {it}: non-finite loss or gradients (loss {loss}); update skipped "
                f"({skipped_in_a_row} in a row, limit {t.max_nonfinite_skips}; train.on_nonfinite=skip)")
            grad_norm = None
        else:
            skipped_in_a_row = 0
            ok, grad_norm, _ = opt.step()
            sched.step(increment=1)
        meter.add(None if loss is not None and not math.isfinite(loss) else loss,
                  sum(lengths) * t.global_batch_size // n_micro,  # every DP rank runs the same lengths
                  dp_size * training_flops(cfg, tok["vocab_size"], lengths, t.micro_batch_size))
        logged = it % t.log_interval == 0 or it == t.train_iters
        if logged:
            now = time.time()
            mean_loss, tok_s = meter.report(now)
            eff = meter.efficiency(now)
            lr = opt.param_groups[0]["lr"]
            metrics.log(it, loss=mean_loss, lr=lr, grad_norm=None if grad_norm is None else float(grad_norm),
                        tokens_per_s=tok_s, **eff, peak_memory_gb=peak_memory_gb())
            mfu = f" MFU {eff['mfu']:.1%}" if eff["mfu"] is not None else ""
            mem = f" {peak_memory_gb():.1f} GB" if torch.cuda.is_available() else ""
            log(f"[train] iter {it:>6}/{t.train_iters} loss {mean_loss or 0:.4f} lr {lr:.2e} "
                f"grad_norm {float(grad_norm or 0):.3f} {tok_s:,.0f} tok/s "
                f"{eff['tflops_per_device']:.3g} TFLOP/s/device{mfu}{mem}")
        if it % t.eval_interval == 0 or it == t.train_iters:
            val = evaluate(cfg, ddp, valid_ds, special)
            metrics.log(it, val_loss=val)
            log(f"[train] iter {it:>6} val_loss {val:.4f}" if val is not None else "")
        saved = it % cfg.checkpoint.save_interval == 0 or it == t.train_iters
        if saved:
            checkpointing.save_checkpoint(ckpt_root, it, ddp.module, opt, sched, cfg.checkpoint.keep_last)
        if it < t.train_iters and preempt.agreed():
            if not saved:
                checkpointing.save_checkpoint(ckpt_root, it, ddp.module, opt, sched, cfg.checkpoint.keep_last)
            if reporting:
                run.preempted.write_text(json.dumps({"iteration": it, "signal": preempt.signal}))
            log(f"[train] preempted ({preempt.signal or 'another rank'}) at iter {it}: checkpoint saved; "
                f"rerunning the same command resumes from it")
            metrics.close()
            dist.barrier()
            dist.destroy_process_group()
            sys.exit(PREEMPTED_EXIT)
        if logged:  # the next interval starts here: evaluation and checkpoint saves are not throughput
            meter.restart(time.time())
    metrics.close()
    dist.barrier()
    dist.destroy_process_group()


PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again"; torchrun reports any failure as 1, hence the marker file too


def _stop_nonfinite(cfg, run_dir: Path, ckpt_root: Path, it: int, in_a_row: int, log, metrics) -> None:
    last = checkpointing.latest_iteration(ckpt_root)
    where = f"the last good checkpoint, iteration {last}, is kept" if last else "no checkpoint was written yet"
    msg = (f"training stopped at iteration {it}: non-finite loss or gradients ({in_a_row} step(s) in a row; "
           f"train.on_nonfinite={cfg.train.on_nonfinite}, max_nonfinite_skips={cfg.train.max_nonfinite_skips}); "
           f"{where}. Lower train.lr, raise warmup, or check the data; train.on_nonfinite=skip skips such steps")
    if metrics.active:  # the reporting rank (the run directory is shared)
        RunDir(run_dir).stopped.write_text(json.dumps({"iteration": it, "message": msg}))
    log(f"[train] {msg}")
    metrics.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(3)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Train a diffusion LM (run under torchrun).")
    p.add_argument("--config", required=True, help="resolved pipeline config YAML")
    p.add_argument("--manifest", required=True, help="data-prep manifest.json")
    p.add_argument("--run-dir", required=True, help="output directory (checkpoints, metrics.jsonl)")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    manifest = json.loads(Path(args.manifest).read_text())
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    train(cfg, manifest, run_dir)


if __name__ == "__main__":  # dist_checkpointing spawns helpers: the guard is required
    sys.exit(main())
