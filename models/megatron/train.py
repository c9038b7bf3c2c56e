"""Training entry point, run under torchrun: `python -m torch.distributed.run ... -m difflm.models.megatron.train`.

One process per rank (gloo on CPU, NCCL on GPU); megatron-core's parallel state, DDP, optimizer and
forward-backward schedules do the parallel work. Writes megatron distributed checkpoints and
metrics.jsonl; resumes from the latest complete checkpoint of its run directory.

The loop has torchtitan's shape: `Trainer.train()` calls `Trainer.train_step()` and, around it, small hooks
(OLMo-core's callbacks, in models/megatron/hooks.py), one policy each: `NonFiniteGuard`, `IntervalLogger`, `Validator`, `Checkpointer`,
`PreemptionWatcher`. A wrapper entry module may install more (`main(hooks=...)`): the tests inject faults so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
from megatron.core.optimizer.optimizer_config import ParamKey
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler, ParamGroupOverride
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from difflm.config import PipelineConfig, load_config
from difflm.config.train import epochs_seen
from difflm.errors import NonFiniteStop, TrainingPreempted
from difflm.manifest import DataManifest
from difflm.models.diffusion.documents import document_ids, document_pairs
from difflm.models.diffusion.modes import Objective, build_objective
from difflm.models.megatron import checkpointing, compat
from difflm.models.megatron.backend import resolve_backend
from difflm.models.megatron.data import build_datasets, micro_batch
from difflm.models.megatron.flops import peak_flops, training_flops
from difflm.models.megatron.forward_step import SpecialTokens, make_forward_step, varilen_length
from difflm.models.megatron.gpt import build_model
from difflm.models.megatron.hooks import Hook, PreemptionFlag, Step, standard_hooks
from difflm.models.megatron.kernels import (
    check_cuda_graphs,
    check_sdpa,
    kernel_settings,
    sdpa_choice,
    sdpa_context,
    use_fused_adam,
)
from difflm.models.megatron.metrics import MetricsWriter
from difflm.rundir import RunDir


def init_distributed(cfg: PipelineConfig) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    compat.activate()  # no-op with CUDA
    threads = cfg.train.torch_threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    torch.set_num_threads(threads)
    init_model_parallel(cfg)


def init_model_parallel(cfg: PipelineConfig) -> None:
    """The tensor/pipeline groups of `cfg`'s layout and their seeded RNG, in an initialised process group."""
    parallel_state.initialize_model_parallel(
        cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    )
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)


def graph_safe_rng(cfg: PipelineConfig) -> None:
    """megatron's CUDA graphs capture the RNG: its graph-safe tracker, reseeded as init_distributed seeds; and
    NCCL's buffer registration off, which megatron requires under expandable_segments (the GPU check's setting).
    Refused first where there is no CUDA device."""
    check_cuda_graphs(cfg.model.cuda_graphs)
    os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed, use_cudagraphable_rng=True, force_reset_rng=True)


def build_training(cfg: PipelineConfig, vocab_size: int, *, objective: Objective):
    """(ddp_model, optimizer, scheduler) for this rank's pipeline stage of `objective`'s model."""
    check_sdpa(cfg.model.sdpa_backend, resolve_backend(cfg.model.backend, objective.two_stream))
    if cfg.model.cuda_graphs != "off":
        graph_safe_rng(cfg)
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
        model = Float16Module(model.config, model)  # the optimizer keeps fp32 main weights
    dist_opt = cfg.parallel.use_distributed_optimizer
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt),
        module=model,
    )
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    o = cfg.train.optimizer
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=cfg.train.schedule.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        clip_grad=o.clip_grad,
        bf16=cfg.train.precision == "bf16",
        fp16=False,
        use_distributed_optimizer=dist_opt,
    )
    opt = get_megatron_optimizer(opt_config, [ddp], config_overrides=param_groups(opt_config, o.decay_embeddings))
    use_fused_adam(opt, kernel_settings(cfg).fused_adam)
    sched = OptimizerParamScheduler(opt, **scheduler_kwargs(cfg))
    return ddp, opt, sched


def param_groups(opt_config: OptimizerConfig, decay_embeddings: bool) -> dict[ParamKey, ParamGroupOverride] | None:
    """megatron's parameter groups: its standard ones (None: biases and norms do not decay), and, when
    `decay_embeddings` is false, none on the word embedding and output layer either (megatron marks both
    `is_embedding_or_output_parameter`, on every pipeline stage that holds a copy)."""
    if decay_embeddings:
        return None
    overrides = get_standard_config_overrides(opt_config)
    overrides[ParamKey(attr="is_embedding_or_output_parameter")] = ParamGroupOverride(wd_mult=0.0)
    return overrides


def scheduler_kwargs(cfg: PipelineConfig) -> dict:
    """megatron OptimizerParamScheduler arguments for train.schedule.lr_schedule (warmup, then the schedule)."""
    t, s, o = cfg.train, cfg.train.schedule, cfg.train.optimizer
    style = {"cosine": "cosine", "linear": "linear", "constant": "constant", "wsd": "WSD"}[s.lr_schedule]
    extra = {}
    if style == "WSD":  # the decay phase takes the last fraction, never the warmup
        decay = max(1, min(round(s.wsd_decay_fraction * t.train_iters), t.train_iters - s.warmup_iters))
        extra = {"wsd_decay_steps": decay, "lr_wsd_decay_style": s.wsd_decay_style}
    return dict(
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=s.min_lr,
        lr_warmup_steps=s.warmup_iters,
        lr_decay_steps=t.train_iters,
        lr_decay_style=style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=t.train_iters,
        wd_incr_style="constant",
        **extra,
    )


def device_peak(cfg: PipelineConfig) -> float | None:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return peak_flops(name, cfg.train.peak_tflops)


def micro_lengths(cfg: PipelineConfig, step: int, n_micro: int, *, objective: Objective) -> list[int]:
    """Sequence length of each micro-batch of training step `step` (variable-length training).

    One draw per micro-batch, as MegaDLMs, for diffusion modes only (the AR baseline always sees full
    windows). Pipeline stages exchange fixed-shape activations, so with PP > 1 the step's micro-batches
    share one length. Keyed by (seed, step, micro): the same on every rank and on resume."""
    t, d = cfg.train, cfg.diffusion
    if d.varilen_prob <= 0 or not objective.varilen:
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
    *,
    step: int,
    noise_step: int,
    forward_only: bool = False,
    lengths: list[int] | None = None,
    attention_pairs: list[float] | None = None,
    reduce: bool = True,
    objective: Objective,
) -> float | torch.Tensor | None:
    """One global batch through megatron's forward-backward schedule; its loss on the last stage.

    `step` picks the data, `noise_step` keys the noise (evaluation uses fixed negative keys so that
    successive evaluations are comparable), `lengths` truncates each micro-batch (variable-length
    training). The loss is sum / count over the whole global batch (every micro-batch and DP rank).
    `attention_pairs`, when given, receives each micro-batch's (query, key) pairs within its packed documents
    (the FLOPs count of document attention). `reduce=False`: this rank's [sum, count] tensor, not reduced and
    not read on the host (the trainer reduces it with the step's flags: `Trainer.agree`). `objective`: the
    trainer's.
    """
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    n_micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp_size)
    lengths = lengths or [cfg.train.seq_length] * n_micro
    micro = [micro_batch(dataset, step, m, dp_rank, cfg, dp_size, lengths[m]) for m in range(n_micro)]
    if attention_pairs is not None:
        # instruction data carries its conversations; pretraining's documents end at EOS
        attention_pairs.extend(
            document_pairs(b["documents"] if "documents" in b else document_ids(b["tokens"], special.eos_id))
            for b in micro
        )
    batches = iter(micro)
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


def evaluate(cfg, ddp, valid, special: SpecialTokens, *, objective: Objective) -> float | None:
    ddp.eval()
    with torch.no_grad():
        vals = [
            run_global_batch(
                cfg, ddp, valid, special, step=i, noise_step=-1 - i, forward_only=True, objective=objective
            )
            for i in range(cfg.train.eval_iters)
        ]
    ddp.train()
    return None if vals[0] is None else sum(float(v) for v in vals if v is not None) / len(vals)


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


class Trainer:
    """One rank's part of a run: process groups, data, model, optimizer and the resumed checkpoint, built on
    construction; `train()` runs `train_step()` for each remaining iteration and the hooks around it."""

    def __init__(
        self,
        cfg: PipelineConfig,
        manifest: DataManifest,
        run_dir: Path,
        hooks: Sequence[Hook],
        clock: Callable[[], float] = time.perf_counter,
    ):
        init_distributed(cfg)
        self.cfg, self.run, self.hooks, self.clock = cfg, RunDir(run_dir), list(hooks), clock
        t = cfg.train
        self.vocab_size, self.special = manifest.tokenizer.vocab_size, SpecialTokens.from_manifest(manifest.tokenizer)
        self.unique_tokens = manifest.unique_tokens  # an epoch: each of them seen once
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
            f"unique_tokens={self.unique_tokens:,} epochs={self.epochs(t.train_iters):.4g} "
            f"params/rank={sum(p.numel() for p in self.ddp.module.parameters()):,}"
        )
        self.log_kernels()
        self.run_hooks("on_start")
        with sdpa_context(self.cfg.model.sdpa_backend):  # forward and backward run inside (autograd's thread too)
            for done in range(self.start, t.train_iters):
                self.run_hooks("pre_step", done)
                self.run_hooks("post_step", self.train_step(done))

    def epochs(self, iteration: int) -> float:
        """Passes over the unique training tokens after `iteration` steps (tokens seen / unique tokens)."""
        t = self.cfg.train
        return epochs_seen(iteration, self.unique_tokens, t.global_batch_size, t.seq_length)

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
        lengths = micro_lengths(self.cfg, done, self.n_micro, objective=self.objective)
        pairs: list[float] | None = [] if self.cfg.model.document_attention else None  # attention within documents
        terms = run_global_batch(
            self.cfg,
            self.ddp,
            self.train_ds,
            self.special,
            step=done,
            noise_step=done,
            lengths=lengths,
            attention_pairs=pairs,
            reduce=False,
            objective=self.objective,
        )
        # every DP rank runs these lengths; with documents, the other ranks' pairs are taken to be this rank's
        per_rank = training_flops(
            self.cfg, self.vocab_size, lengths, t.micro_batch_size, pairs, objective=self.objective
        )
        flops = self.dp_size * per_rank
        tokens = sum(lengths) * t.global_batch_size // self.n_micro
        assert terms is None or isinstance(terms, torch.Tensor)  # reduce=False: this rank's [sum, count]
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
        return evaluate(self.cfg, self.ddp, self.valid_ds, self.special, objective=self.objective)

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


def train(cfg: PipelineConfig, manifest: DataManifest, run_dir: Path, hooks: Sequence[Hook] = ()) -> None:
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
    p.add_argument("--manifest", required=True, help="data-prep manifest.json (a run's data_manifest.json)")
    p.add_argument("--run-dir", required=True, help="output directory (checkpoints, metrics.jsonl)")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    manifest = DataManifest.read(args.manifest)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    train(cfg, manifest, run_dir, hooks)


if __name__ == "__main__":  # dist_checkpointing spawns helpers: the guard is required
    main()
