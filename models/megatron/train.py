"""Training entry point, run under torchrun: `python -m torch.distributed.run ... -m models.megatron.train`.

One process per rank (gloo on CPU, NCCL on GPU); megatron-core's parallel state, DDP, optimizer and
forward-backward schedules do the parallel work. Writes megatron distributed checkpoints and
metrics.jsonl; resumes from the latest complete checkpoint of its run directory.

The loop has torchtitan's shape: `Trainer.train()` calls `Trainer.train_step()` and, around it, small hooks
(OLMo-core's callbacks), one policy each: `NonFiniteGuard`, `IntervalLogger`, `Validator`, `Checkpointer`,
`PreemptionWatcher`. A wrapper entry module may install more (`main(hooks=...)`): the tests inject faults so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from difflm.config import PipelineConfig, load_config
from difflm.errors import NonFiniteStop, TrainingPreempted
from difflm.rundir import RunDir
from models.diffusion.documents import document_ids, document_pairs
from models.diffusion.modes import Objective, build_objective
from models.megatron import checkpointing
from models.megatron.backend import resolve_backend
from models.megatron.data import build_datasets, micro_batch
from models.megatron.flops import efficiency, peak_flops, training_flops
from models.megatron.forward_step import SpecialTokens, make_forward_step, varilen_length
from models.megatron.gpt import build_model
from models.megatron.kernels import check_sdpa, kernel_settings, sdpa_choice, sdpa_context, use_fused_adam
from models.megatron.metrics import MetricsWriter


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


def build_training(cfg: PipelineConfig, vocab_size: int, *, objective: Objective | None = None):
    """(ddp_model, optimizer, scheduler) for this rank's pipeline stage of `objective`'s model (`cfg`'s by default)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    objective = objective or build_objective(cfg.diffusion)
    check_sdpa(cfg.model.sdpa_backend, resolve_backend(cfg.model.backend, objective.two_stream))
    model = build_model(
        cfg,
        vocab_size,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        objective=objective,
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
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            clip_grad=t.clip_grad,
            bf16=t.precision == "bf16",
            fp16=False,
            use_distributed_optimizer=dist_opt,
        ),
        [ddp],
    )
    use_fused_adam(opt, kernel_settings(cfg).fused_adam)
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
    return dict(
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.warmup_iters,
        lr_decay_steps=t.train_iters,
        lr_decay_style=style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.train_iters,
        wd_incr_style="constant",
        **extra,
    )


class IntervalMeter:
    """What one log line reports: the mean loss over the logging interval (not one step's), the tokens really
    processed per second (variable-length steps count their true lengths), and the model FLOPs of those
    tokens (attention included, from the config: models/megatron/flops.py) as TFLOP/s and MFU per device."""

    def __init__(self, now: float, n_devices: int = 1, peak: float | None = None):
        self.n_devices, self.peak = n_devices, peak
        self.restart(now)

    def restart(self, now: float) -> None:
        self.tic, self.tokens, self.flops, self.losses, self.excluded = now, 0, 0.0, [], 0.0

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` of this interval (evaluation, checkpoint saves) out of its throughput."""
        self.excluded += seconds

    def _seconds(self, now: float) -> float:
        return max(now - self.tic - self.excluded, 1e-9)

    def add(self, loss: float | None, tokens: int, flops: float = 0.0) -> None:
        self.tokens += tokens
        self.flops += flops
        if loss is not None:  # only the last pipeline stage has the loss
            self.losses.append(loss)

    def report(self, now: float) -> tuple[float | None, float]:
        mean = sum(self.losses) / len(self.losses) if self.losses else None
        return mean, self.tokens / self._seconds(now)

    def efficiency(self, now: float) -> dict:
        """tokens_per_s_per_device, tflops_per_device, mfu (None without a known device peak)."""
        seconds = self._seconds(now)
        return {
            "tokens_per_s_per_device": self.tokens / seconds / self.n_devices,
            **efficiency(self.flops, seconds, self.n_devices, self.peak),
        }


def device_peak(cfg: PipelineConfig) -> float | None:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return peak_flops(name, cfg.train.peak_tflops)


def peak_memory_gb() -> float | None:
    """The most GPU memory this rank's tensors have held (None on the CPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def micro_lengths(cfg: PipelineConfig, step: int, n_micro: int, objective: Objective | None = None) -> list[int]:
    """Sequence length of each micro-batch of training step `step` (variable-length training).

    One draw per micro-batch, as MegaDLMs, for diffusion modes only (the AR baseline always sees full
    windows). Pipeline stages exchange fixed-shape activations, so with PP > 1 the step's micro-batches
    share one length. Keyed by (seed, step, micro): the same on every rank and on resume."""
    t, d = cfg.train, cfg.diffusion
    if d.varilen_prob <= 0 or not (objective or build_objective(d)).varilen:
        return [t.seq_length] * n_micro
    one = cfg.parallel.pipeline_model_parallel_size > 1
    return [
        varilen_length(
            t.seed, step, t.seq_length, d.varilen_prob, cfg.parallel.tensor_model_parallel_size, 0 if one else m
        )
        for m in range(n_micro)
    ]


def run_global_batch(
    cfg,
    ddp,
    dataset,
    special: SpecialTokens,
    step: int,
    noise_step: int,
    forward_only: bool,
    lengths: list[int] | None = None,
    attention_pairs: list[int] | None = None,
    reduce: bool = True,
    objective: Objective | None = None,
) -> float | torch.Tensor | None:
    """One global batch through megatron's forward-backward schedule; its loss on the last stage.

    `step` picks the data, `noise_step` keys the noise (evaluation uses fixed negative keys so that
    successive evaluations are comparable), `lengths` truncates each micro-batch (variable-length
    training). The loss is sum / count over the whole global batch (every micro-batch and DP rank).
    `attention_pairs`, when given, receives each micro-batch's (query, key) pairs within its packed documents
    (the FLOPs count of document attention). `reduce=False`: this rank's [sum, count] tensor, not reduced and
    not read on the host (the trainer reduces it with the step's flags: `Trainer.agree`). `objective`: the
    trainer's (`cfg`'s when not given).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    n_micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp_size)
    lengths = lengths or [cfg.train.seq_length] * n_micro
    micro = [micro_batch(dataset, step, m, dp_rank, cfg, dp_size, lengths[m]) for m in range(n_micro)]
    if attention_pairs is not None:
        attention_pairs.extend(document_pairs(document_ids(b["tokens"], special.eos_id)) for b in micro)
    batches = iter(micro)
    objective = objective or build_objective(cfg.diffusion, special.ids())
    losses = get_forward_backward_func()(
        forward_step_func=make_forward_step(cfg, special, noise_step, evaluation=forward_only, objective=objective),
        data_iterator=batches,
        model=[ddp],
        num_microbatches=n_micro,
        seq_length=objective.model_tokens(max(lengths)),  # block diffusion: [x_t | x_0]
        micro_batch_size=cfg.train.micro_batch_size * objective.rows_per_sequence(forward_only),
        forward_only=forward_only,
    )
    if not parallel_state.is_pipeline_last_stage():
        return None
    total = torch.stack([x["loss"] for x in losses]).sum(0)  # [sum, count] of this rank
    if not reduce:
        return total
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return float(total[0] / total[1].clamp(min=1))


def evaluate(cfg, ddp, valid, special: SpecialTokens, objective: Objective | None = None) -> float | None:
    ddp.eval()
    with torch.no_grad():
        vals = [
            run_global_batch(cfg, ddp, valid, special, i, -1 - i, True, objective=objective)
            for i in range(cfg.train.eval_iters)
        ]
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


def step_vector(ddp, loss_terms: torch.Tensor | None, owns_loss: bool, signalled: bool) -> torch.Tensor:
    """[loss sum, token count, non-finite, preempt] of this rank, built on the device without a host read.

    Summed over every rank it gives the data-parallel loss (only the ranks that own a copy of it add theirs: the
    last pipeline stage, tensor-parallel rank 0) and, where > 0, "some rank saw a non-finite loss or gradient" and
    "some rank got a preemption signal": what used to take three all-reduces and a host read per gradient buffer."""
    vec = torch.zeros(4, device=_device())
    bad = torch.zeros((), device=vec.device)
    if loss_terms is not None:
        if owns_loss:
            vec[:2] = loss_terms.to(vec.device, torch.float32)
        bad = bad + (~torch.isfinite(loss_terms[0])).float()
    for buf in getattr(ddp, "buffers", []):  # megatron DDP: contiguous gradient buffers, one reduction each
        # the largest magnitude is finite iff every gradient is (NaN propagates): no buffer-sized bool copy
        bad = bad + (~torch.isfinite(torch.linalg.vector_norm(buf.grad_data, float("inf")))).float()
    vec[2] = bad
    vec[3] = 1.0 if signalled else 0.0
    return vec


# ---- the loop: one named step, then the hooks (torchtitan's trainer.py, OLMo-core's callbacks) -------------


@dataclass
class Step:
    """One training iteration as the hooks see it. `it` counts iterations done, as megatron does: 1 after the
    first step, and checkpoint iter_0000001 holds the weights after it."""

    it: int
    loss: float | None  # the global batch's loss once agreed; None off the last pipeline stage
    tokens: int  # the tokens the step processed, over every data-parallel rank
    flops: float  # their model FLOPs
    grad_norm: float | None = None  # None while no update was applied
    skip_update: bool = False  # set before the update by a hook that vetoes it (NonFiniteGuard)
    loss_terms: torch.Tensor | None = None  # this rank's [sum, count] until agreed (last pipeline stage only)
    agreed: bool = False  # `Trainer.agree` ran: loss, finite and preempted hold every rank's answer
    finite: bool = True  # the loss and every gradient finite on every rank
    preempted: bool = False  # some rank got a preemption signal before the step was agreed


class Hook:
    """A policy around the training step. The trainer calls each method of every hook, in the order the hooks
    were installed, on every rank; a hook that ends training raises (NonFiniteStop, TrainingPreempted).

    `counts_as_training = False`: the hook's time is not training time (evaluation, checkpoint saves). The
    trainer adds it up in `excluded_s`, which the throughput and MFU of a logging interval leave out."""

    counts_as_training = True

    def on_start(self, trainer: Trainer) -> None:
        """Once, after the model is built and a checkpoint resumed, before the first step."""

    def pre_step(self, trainer: Trainer, done: int) -> None:
        """Before each step; `done`: the iterations trained so far."""

    def pre_optim_step(self, trainer: Trainer, step: Step) -> None:
        """After the backward pass, before the optimizer update (`step.skip_update` cancels it)."""

    def post_step(self, trainer: Trainer, step: Step) -> None:
        """After the update."""


class NonFiniteGuard(Hook):
    """A non-finite loss or gradient on any rank: the update is skipped (train.on_nonfinite=skip, at most
    train.max_nonfinite_skips in a row), or training stops (stopped.json; the last good checkpoint is kept)."""

    def __init__(self):
        self.in_a_row = self.total = 0

    def on_start(self, trainer: Trainer) -> None:
        trainer.run.stopped.unlink(missing_ok=True)

    def pre_optim_step(self, trainer: Trainer, step: Step) -> None:
        if trainer.agree(step).finite:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        step.skip_update = True
        trainer.metrics.log(step.it, nonfinite_skipped=self.total)
        t = trainer.cfg.train
        if t.on_nonfinite == "stop" or self.in_a_row > t.max_nonfinite_skips:
            self._stop(trainer, step.it)
        trainer.log(
            f"[train] iter {step.it}: non-finite loss or gradients (loss {step.loss}); update skipped "
            f"({self.in_a_row} in a row, limit {t.max_nonfinite_skips}; train.on_nonfinite=skip)"
        )

    def _stop(self, trainer: Trainer, it: int) -> None:
        t = trainer.cfg.train
        last = checkpointing.latest_iteration(trainer.run.checkpoints)
        where = f"the last good checkpoint, iteration {last}, is kept" if last else "no checkpoint was written yet"
        msg = (
            f"training stopped at iteration {it}: non-finite loss or gradients ({self.in_a_row} step(s) in a "
            f"row; train.on_nonfinite={t.on_nonfinite}, max_nonfinite_skips={t.max_nonfinite_skips}); "
            f"{where}. Lower train.lr, raise warmup, or check the data; train.on_nonfinite=skip skips such steps"
        )
        if trainer.reporting:  # one rank writes: the run directory is shared
            trainer.run.stopped.write_text(json.dumps({"iteration": it, "message": msg}))
        trainer.log(f"[train] {msg}")
        raise NonFiniteStop(msg)


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`: short enough for a log line."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class IntervalLogger(Hook):
    """Every train.log_interval iterations and after the last: the interval's mean loss, the lr, grad norm,
    tokens/s, TFLOP/s and MFU per device and peak memory, into metrics.jsonl and the log. Time the hooks spent
    outside training (evaluation, checkpoint saves) is left out of the interval, wherever it falls."""

    def on_start(self, trainer: Trainer) -> None:
        self.meter = IntervalMeter(trainer.clock(), trainer.n_devices, trainer.peak)
        self.excluded_at = trainer.excluded_s
        self.mark: tuple[int, float] | None = None  # (iteration, clock) of the first report: the ETA's pace

    def post_step(self, trainer: Trainer, step: Step) -> None:
        finite = step.loss is None or math.isfinite(step.loss)
        self.meter.add(step.loss if finite else None, step.tokens, step.flops)
        t = trainer.cfg.train
        if step.it % t.log_interval and step.it != t.train_iters:
            return
        now = trainer.clock()
        self.meter.exclude(trainer.excluded_s - self.excluded_at)
        mean_loss, tok_s = self.meter.report(now)
        eff = self.meter.efficiency(now)
        lr = trainer.opt.param_groups[0]["lr"]
        memory = peak_memory_gb()
        trainer.metrics.log(
            step.it,
            loss=mean_loss,
            lr=lr,
            grad_norm=None if step.grad_norm is None else float(step.grad_norm),
            tokens_per_s=tok_s,
            **eff,
            peak_memory_gb=memory,
        )
        mfu = f" MFU {eff['mfu']:.1%}" if eff["mfu"] is not None else ""
        mem = f" {memory:.1f} GB" if memory is not None else ""
        eta = ""
        # the mean pace since the first report (warm-up left out), evaluations and saves included: one interval's
        # pace jumped 20x when an evaluation or a busy neighbour fell in it (measured on the shared CPU)
        if self.mark is not None and step.it < t.train_iters:
            per_step = (now - self.mark[1]) / max(step.it - self.mark[0], 1)
            eta = f" ETA {format_duration(per_step * (t.train_iters - step.it))}"
        self.mark = self.mark or (step.it, now)
        trainer.log(
            f"[train] iter {step.it:>6}/{t.train_iters} loss {mean_loss or 0:.4f} lr {lr:.2e} "
            f"grad_norm {float(step.grad_norm or 0):.3f} {tok_s:,.0f} tok/s "
            f"{eff['tflops_per_device']:.3g} TFLOP/s/device{mfu}{mem}{eta}"
        )
        self.meter.restart(now)
        self.excluded_at = trainer.excluded_s


class Validator(Hook):
    """val_loss over the fixed validation batches: before the first step of a fresh run (iteration 0), every
    train.eval_interval iterations and after the last."""

    counts_as_training = False

    def pre_step(self, trainer: Trainer, done: int) -> None:
        if done == 0:
            trainer.metrics.log(0, val_loss=trainer.validate())

    def post_step(self, trainer: Trainer, step: Step) -> None:
        t = trainer.cfg.train
        if step.it % t.eval_interval == 0 or step.it == t.train_iters:
            val = trainer.validate()
            trainer.metrics.log(step.it, val_loss=val)
            trainer.log(f"[train] iter {step.it:>6} val_loss {val:.4f}" if val is not None else "")


class Checkpointer(Hook):
    """A checkpoint every checkpoint.save_interval iterations and after the last (the newest keep_last kept)."""

    counts_as_training = False

    def post_step(self, trainer: Trainer, step: Step) -> None:
        if step.it % trainer.cfg.checkpoint.save_interval == 0 or step.it == trainer.cfg.train.train_iters:
            trainer.save(step.it)


class PreemptionWatcher(Hook):
    """A preemption signal (train.preempt_signals) to any rank: the step in flight finishes, every rank agrees,
    a checkpoint is saved (unless this step's already was), preempted.json says so, and training ends with
    TrainingPreempted (exit 75: rerunning the same command resumes). The last step is never interrupted."""

    def on_start(self, trainer: Trainer) -> None:
        trainer.run.preempted.unlink(missing_ok=True)
        self.flag = trainer.preemption = PreemptionFlag(trainer.cfg.train.preempt_signals)

    def post_step(self, trainer: Trainer, step: Step) -> None:
        if step.it >= trainer.cfg.train.train_iters or not trainer.agree(step).preempted:
            return
        if trainer.saved != step.it:
            trainer.save(step.it)
        if trainer.reporting:
            trainer.run.preempted.write_text(json.dumps({"iteration": step.it, "signal": self.flag.signal}))
        trainer.log(
            f"[train] preempted ({self.flag.signal or 'another rank'}) at iter {step.it}: checkpoint saved; "
            f"rerunning the same command resumes from it"
        )
        raise TrainingPreempted(f"training preempted at iteration {step.it}", step.it)


def standard_hooks() -> list[Hook]:
    """The production policies, in the order they run after each step: the log line of an interval, then
    validation and the checkpoint of that iteration, then the preemption check (which saves only when the
    checkpointer did not)."""
    return [NonFiniteGuard(), IntervalLogger(), Validator(), Checkpointer(), PreemptionWatcher()]


class Trainer:
    """One rank's part of a run: process groups, data, model, optimizer and the resumed checkpoint, built on
    construction; `train()` runs `train_step()` for each remaining iteration and the hooks around it."""

    def __init__(
        self,
        cfg: PipelineConfig,
        manifest: dict,
        run_dir: Path,
        hooks: Sequence[Hook],
        clock: Callable[[], float] = time.perf_counter,
    ):
        from megatron.core import parallel_state

        init_distributed(cfg)
        self.cfg, self.run, self.hooks, self.clock = cfg, RunDir(run_dir), list(hooks), clock
        t = cfg.train
        tok = manifest["tokenizer"]
        self.vocab_size, self.special = tok["vocab_size"], SpecialTokens.from_manifest(tok)
        self.objective = build_objective(cfg.diffusion, self.special.ids())  # the one reading of the mode
        self.train_ds, self.valid_ds = build_datasets(
            cfg, manifest, t.train_iters * t.global_batch_size, (t.eval_iters + 1) * t.global_batch_size
        )
        self.ddp, self.opt, self.sched = build_training(cfg, self.vocab_size, objective=self.objective)
        self.start = 0
        latest = checkpointing.latest_iteration(self.run.checkpoints)
        if latest is not None:
            self.start = checkpointing.load_checkpoint(
                self.run.checkpoints, latest, self.ddp.module, self.opt, self.sched
            )
            use_fused_adam(self.opt, kernel_settings(cfg).fused_adam)  # the loaded param groups carry the saver's
        elif t.init_from:
            checkpointing.load_model_weights(Path(t.init_from), self.ddp.module)
        self.reporting = (
            parallel_state.is_pipeline_last_stage()
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0
        )
        self.log = (lambda msg: print(msg, flush=True)) if self.reporting else (lambda msg: None)
        # this attempt logs from its first step on (iteration 0 from scratch): an interrupted attempt's records
        # from there on are dropped, or metrics.jsonl and MLflow would hold two values per step
        self.metrics = MetricsWriter(
            self.run.metrics_file,
            self.reporting,
            os.environ.get("DIFFLM_MLFLOW_RUN_ID"),
            self.log,
            first_step=0 if latest is None else self.start + 1,
        )
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.n_micro = t.global_batch_size // (t.micro_batch_size * self.dp_size)
        self.n_devices, self.peak = dist.get_world_size(), device_peak(cfg)
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.owns_loss = self.last_stage and parallel_state.get_tensor_model_parallel_rank() == 0
        self.preemption: PreemptionFlag | None = None  # set by PreemptionWatcher
        self.kernels = kernel_settings(cfg)
        self.saved: int | None = None  # the iteration this attempt saved last
        self.excluded_s = 0.0  # seconds the hooks spent outside training (Hook.counts_as_training)

    def train(self) -> None:
        t = self.cfg.train
        self.log(
            f"[train] mode={self.objective.name} start_iter={self.start} train_iters={t.train_iters} "
            f"params/rank={sum(p.numel() for p in self.ddp.module.parameters()):,}"
        )
        self.log_kernels()
        self.run_hooks("on_start")
        with sdpa_context(self.cfg.model.sdpa_backend):  # forward and backward run inside (autograd's thread too)
            for done in range(self.start, t.train_iters):
                self.run_hooks("pre_step", done)
                self.run_hooks("post_step", self.train_step(done))

    def log_kernels(self) -> None:
        """Once: the kernels this run uses (models/megatron/kernels.py) and the attention kernel SDPA picks at the
        configured layout, in the log beside the run's other settings (metrics.jsonl holds numbers only)."""
        model = self.ddp.module
        param = next(model.parameters())
        backend = resolve_backend(self.cfg.model.backend, self.objective.two_stream)
        bidirectional = self.objective.bidirectional
        sdpa = sdpa_choice(self.cfg, param.device, param.dtype, bidirectional) if backend == "torch" else None
        settings = {**self.kernels.describe(), "backend": backend, "sdpa_kernel": sdpa}
        self.log(f"[train] kernels: {json.dumps(settings)}")

    def train_step(self, done: int) -> Step:
        """Forward and backward over global batch `done`, the hooks' look at it, then the optimizer update."""
        t = self.cfg.train
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        lengths = micro_lengths(self.cfg, done, self.n_micro, self.objective)
        pairs = [] if self.cfg.model.document_attention else None  # attention kept within packed documents
        terms = run_global_batch(
            self.cfg,
            self.ddp,
            self.train_ds,
            self.special,
            done,
            done,
            False,
            lengths,
            pairs,
            reduce=False,
            objective=self.objective,
        )
        # every DP rank runs these lengths; with documents, the other ranks' pairs are taken to be this rank's
        per_rank = training_flops(
            self.cfg, self.vocab_size, lengths, t.micro_batch_size, pairs, objective=self.objective
        )
        flops = self.dp_size * per_rank
        tokens = sum(lengths) * t.global_batch_size // self.n_micro
        step = Step(it=done + 1, loss=None, tokens=tokens, flops=flops, loss_terms=terms)
        self.run_hooks("pre_optim_step", step)
        self.agree(step)  # (done by NonFiniteGuard already, unless a hook list leaves it out)
        if not step.skip_update:
            _, step.grad_norm, _ = self.opt.step()
            self.sched.step(increment=1)
        return step

    def agree(self, step: Step) -> Step:
        """Every rank's loss, finite flag and preemption flag in ONE all-reduce and ONE host read per step (the
        skip decision needs it on the host before the update; megatron's grad-norm read follows anyway)."""
        if step.agreed:
            return step
        signalled = self.preemption is not None and self.preemption.signal is not None
        vec = step_vector(self.ddp, step.loss_terms, self.owns_loss, signalled)
        dist.all_reduce(vec)
        # the loss as the per-group reduction computed it (fp32 sum / clamped count), read with the flags
        _, _, bad, stop, loss = torch.cat([vec, (vec[0] / vec[1].clamp(min=1)).reshape(1)]).tolist()
        step.loss = loss if self.last_stage else None
        step.finite, step.preempted, step.agreed = bad == 0, stop > 0, True
        return step

    def validate(self) -> float | None:
        return evaluate(self.cfg, self.ddp, self.valid_ds, self.special, self.objective)

    def save(self, it: int) -> None:
        checkpointing.save_checkpoint(
            self.run.checkpoints, it, self.ddp.module, self.opt, self.sched, self.cfg.checkpoint.keep_last
        )
        self.saved = it

    def run_hooks(self, method: str, *args) -> None:
        for hook in self.hooks:
            tic = self.clock()
            getattr(hook, method)(self, *args)
            if not hook.counts_as_training:
                self.excluded_s += self.clock() - tic

    def close(self) -> None:
        """Flush the metrics and leave the process group together (every rank calls it)."""
        self.metrics.close()
        dist.barrier()
        dist.destroy_process_group()


PREEMPTED_EXIT = TrainingPreempted.exit_code  # 75, EX_TEMPFAIL: "try again"; torchrun reports any failure as 1,
NONFINITE_EXIT = 3  # hence the marker files too (preempted.json, stopped.json)


def train(cfg: PipelineConfig, manifest: dict, run_dir: Path, hooks: Sequence[Hook] = ()) -> None:
    """Train the run in `run_dir` on this rank. `hooks` run before the standard ones, so that a test's fault
    injector changes a step before the NonFiniteGuard looks at it. A stop on purpose exits with its code."""
    trainer = Trainer(cfg, manifest, run_dir, [*hooks, *standard_hooks()])
    try:
        trainer.train()
    except TrainingPreempted:
        code = PREEMPTED_EXIT
    except NonFiniteStop:
        code = NONFINITE_EXIT
    else:
        code = 0
    trainer.close()
    if code:
        sys.exit(code)


def main(argv: list[str] | None = None, hooks: Sequence[Hook] = ()) -> None:
    """The torchrun entry point. A wrapper entry module may pass `hooks` (tests install a FaultInjector so)."""
    p = argparse.ArgumentParser(description="Train a diffusion LM (run under torchrun).")
    p.add_argument("--config", required=True, help="resolved pipeline config YAML")
    p.add_argument("--manifest", required=True, help="data-prep manifest.json")
    p.add_argument("--run-dir", required=True, help="output directory (checkpoints, metrics.jsonl)")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    manifest = json.loads(Path(args.manifest).read_text())
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    train(cfg, manifest, run_dir, hooks)


if __name__ == "__main__":  # dist_checkpointing spawns helpers: the guard is required
    sys.exit(main())
