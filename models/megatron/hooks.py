"""The hooks around the training step (OLMo-core's callbacks), one policy each: `NonFiniteGuard`,
`IntervalLogger`, `Validator`, `Checkpointer`, `PreemptionWatcher`, with what they use (`Step`, `IntervalMeter`,
`PreemptionFlag`). `models/megatron/train.py`'s `Trainer` calls them; a wrapper entry module may install more
(`train.main(hooks=...)`): the tests inject faults so.
"""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from difflm.errors import NonFiniteStop, TrainingPreempted
from difflm.models.megatron import checkpointing
from difflm.models.megatron.flops import efficiency

if TYPE_CHECKING:  # the trainer imports these hooks: at run time a hook only calls the trainer it is handed
    from difflm.models.megatron.train import Trainer

try:  # megatron's async checkpoint writer; another megatron version may lack it
    from megatron.core.dist_checkpointing.strategies import filesystem_async
except ImportError:
    filesystem_async = None


class IntervalMeter:
    """What one log line reports: the mean loss over the logging interval (not one step's), the tokens really
    processed per second (variable-length steps count their true lengths), and the model FLOPs of those
    tokens (attention included, from the config: models/megatron/flops.py) as TFLOP/s and MFU per device."""

    def __init__(self, now: float, n_devices: int = 1, peak: float | None = None):
        self.n_devices, self.peak = n_devices, peak
        self.restart(now)

    def restart(self, now: float) -> None:
        self.losses: list[float] = []
        self.tic, self.tokens, self.flops, self.excluded = now, 0, 0.0, 0.0

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


def peak_memory_gb() -> float | None:
    """The most GPU memory this rank's tensors have held (None on the CPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


# Ctrl-C: the local launcher forwards the signal it got (SIGINT), which stops training as a preemption does
INTERACTIVE_STOP = "SIGINT"


class PreemptionFlag:
    """Set by the configured signals and by SIGINT; the step in flight finishes, then every rank agrees to stop.
    `signal`: the name of the signal received, as the log and preempted.json say it."""

    def __init__(self, names: Sequence[str]):
        self.signal: str | None = None
        sigs = [getattr(signal, name) for name in dict.fromkeys([*names, INTERACTIVE_STOP])]
        _start_checkpoint_writer_immune(sigs)
        for sig in sigs:
            signal.signal(sig, self._handler)

    def _handler(self, signum, _frame) -> None:
        self.signal = signal.Signals(signum).name


def _start_checkpoint_writer_immune(sigs: list) -> None:
    """torchrun signals a rank's whole process group, which includes the helper process megatron's
    checkpoint writer spawns on its first save: started while the signals are ignored (a disposition a spawned
    interpreter inherits), it outlives the signal and the checkpoint written on it completes."""
    start = getattr(filesystem_async, "_get_write_results_queue", None)
    if start is None:  # no such writer in this megatron version: nothing to prepare
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        start()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---- one named step, then the hooks (torchtitan's trainer.py, OLMo-core's callbacks) -----------------------


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
    """A non-finite loss or gradient on any rank: the update is skipped (train.faults.on_nonfinite=skip, at most
    train.faults.max_nonfinite_skips in a row), or training stops (stopped.json; the last good checkpoint is kept)."""

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
        t = trainer.cfg.train.faults
        if t.on_nonfinite == "stop" or self.in_a_row > t.max_nonfinite_skips:
            self._stop(trainer, step.it)
        trainer.log(
            f"[train] iter {step.it}: non-finite loss or gradients (loss {step.loss}); update skipped "
            f"({self.in_a_row} in a row, limit {t.max_nonfinite_skips}; train.faults.on_nonfinite=skip)"
        )

    def _stop(self, trainer: Trainer, it: int) -> None:
        t = trainer.cfg.train.faults
        last = checkpointing.latest_iteration(trainer.run.checkpoints)
        where = f"the last good checkpoint, iteration {last}, is kept" if last else "no checkpoint was written yet"
        msg = (
            f"training stopped at iteration {it}: non-finite loss or gradients ({self.in_a_row} step(s) in a "
            f"row; train.faults.on_nonfinite={t.on_nonfinite}, max_nonfinite_skips={t.max_nonfinite_skips}); "
            f"{where}. Lower train.optimizer.lr, raise warmup, or check the data; train.faults.on_nonfinite=skip skips such steps"
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
    tokens/s, TFLOP/s and MFU per device, peak memory and the epochs seen, into metrics.jsonl and the log. Time the hooks spent
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
            epochs=trainer.epochs(step.it),
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
    """A preemption signal (train.faults.preempt_signals) to any rank: the step in flight finishes, every rank agrees,
    a checkpoint is saved (unless this step's already was), preempted.json says so, and training ends with
    TrainingPreempted (exit 75: rerunning the same command resumes). The last step is never interrupted."""

    def on_start(self, trainer: Trainer) -> None:
        trainer.run.preempted.unlink(missing_ok=True)
        self.flag = trainer.preemption = PreemptionFlag(trainer.cfg.train.faults.preempt_signals)

    def post_step(self, trainer: Trainer, step: Step) -> None:
        if step.it >= trainer.cfg.train.train_iters or not trainer.agree(step).preempted:
            return
        if trainer.saved != step.it:
            trainer.save(step.it)
        if trainer.reporting:
            trainer.run.preempted.write_text(json.dumps({"iteration": step.it, "signal": self.flag.signal}))
        why = f"{self.flag.signal} received" if self.flag.signal else "another rank was signalled"
        trainer.log(
            f"[train] stopping at iter {step.it} ({why}): checkpoint saved; rerunning the same command resumes from it"
        )
        raise TrainingPreempted(f"training preempted at iteration {step.it}", step.it)


def standard_hooks() -> list[Hook]:
    """The production policies, in the order they run after each step: the log line of an interval, then
    validation and the checkpoint of that iteration, then the preemption check (which saves only when the
    checkpointer did not)."""
    return [NonFiniteGuard(), IntervalLogger(), Validator(), Checkpointer(), PreemptionWatcher()]
