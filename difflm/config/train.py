"""The `train` section: run length and numerics on the section itself, with the optimizer, the learning-rate
schedule, the fault policy and the launch as its sub-sections (`train.optimizer.lr`, `train.schedule.warmup_iters`,
`train.faults.on_nonfinite`, `train.launch.launcher`). The run's name reads the sub-sections as the flat section
of before (FLATTEN), and the flat spellings (`train.lr=...`) still work for a release."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from difflm.config.base import FLATTEN, IF_SET, OPERATIONAL, _Section, deprecated
from difflm.config.launch import WAIT_FIELDS, LaunchConfig


def is_hf_folder(path: str | None) -> bool:
    """A Hugging Face model folder (config.json), not a megatron checkpoint (metadata.json)."""
    if not path:
        return False
    folder = Path(path).expanduser()
    return (folder / "config.json").exists() and not (folder / "metadata.json").exists()


Signal = Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"]


def _default_signals() -> list[Signal]:
    return ["SIGTERM", "SIGUSR1"]


class OptimizerConfig(_Section):
    """AdamW: `train.optimizer`."""

    lr: float = Field(3e-3, gt=0.0, description="Peak learning rate (after warmup).")
    weight_decay: float = Field(0.01, ge=0.0)
    decay_embeddings: bool = Field(
        True,
        description="Whether weight decay applies to the input embedding and the output layer (megatron's and "
        "MegaDLMs' default). The strong AR arm of Xu et al. 2026 spares them: false. Biases and norms never decay.",
        json_schema_extra=IF_SET,  # true decays as every run before it did
    )
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.98, ge=0.0, lt=1.0)
    clip_grad: float = Field(1.0, ge=0.0, description="Clip the gradient's global norm to this (0: off).")


class ScheduleConfig(_Section):
    """The learning rate over the run: `train.schedule`."""

    warmup_iters: int = Field(20, ge=0, description="Linear warmup from 0 to train.optimizer.lr.")
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine",
        description="After warmup: cosine or linear decay to min_lr over the run, constant at lr, or "
        "wsd (warmup-stable-decay): constant at lr, then decay to min_lr over the last wsd_decay_fraction.",
    )
    min_lr: float = Field(3e-4, ge=0.0, description="Where the decay ends.")
    wsd_decay_fraction: float = Field(0.2, gt=0.0, le=1.0, description="wsd: share of train_iters spent decaying.")
    wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = Field(
        "linear", description="wsd: shape of the final decay (megatron's lr_wsd_decay_style)."
    )


class FaultsConfig(_Section):
    """What the trainer does on a non-finite step or a preemption signal: `train.faults`. Operational."""

    on_nonfinite: Literal["skip", "stop"] = Field(
        "skip",
        json_schema_extra=OPERATIONAL,
        description="A NaN/Inf loss or gradient: skip the update and count it, or stop (the last good "
        "checkpoint is kept and the message names the step).",
    )
    max_nonfinite_skips: int = Field(
        10, ge=1, json_schema_extra=OPERATIONAL, description="Consecutive skipped steps before training stops anyway."
    )
    preempt_signals: list[Signal] = Field(
        default_factory=_default_signals,
        json_schema_extra=OPERATIONAL,
        description="Signals on which the trainer finishes the "
        "current step, writes a checkpoint and exits as preempted (rerun / requeue resumes).",
    )


# The flat spellings of before the sub-sections (train.<old> -> train.<section>.<old>), read for a release.
MOVED = {
    **dict.fromkeys(OptimizerConfig.model_fields, "optimizer"),
    **dict.fromkeys(ScheduleConfig.model_fields, "schedule"),
    **dict.fromkeys(FaultsConfig.model_fields, "faults"),
    **dict.fromkeys(("launcher", "nproc_per_node", "nnodes", "slurm", "kubernetes"), "launch"),
}


def nest_train_fields(train: dict[str, Any]) -> dict[str, Any]:
    """`train` with the flat keys of before (`lr`, `launcher`, `slurm`, ...) moved into their sub-sections
    (`optimizer.lr`, `launch.launcher`, `launch.slurm`); a setting given both ways is an error naming the one
    spelling."""
    if not any(k in MOVED for k in train):
        return train
    data = dict(train)
    for old in [k for k in data if k in MOVED]:
        section = MOVED[old]
        sub = data.get(section)
        sub = dict(sub) if isinstance(sub, dict) else {}
        if old in sub:
            raise ValueError(
                f"train.{old} is the old spelling of train.{section}.{old}, which is also given: "
                f"set only train.{section}.{old}"
            )
        deprecated(f"train.{old}", f"train.{section}.{old}")
        sub[old] = data.pop(old)
        data[section] = sub
    return data


def new_train_key(keys: list[str]) -> list[str]:
    """An override's key in the new spelling: `train.lr` -> `train.optimizer.lr`, `train.slurm.poll_seconds` ->
    `train.launch.wait.poll_seconds`."""
    new = keys
    if len(keys) >= 2 and keys[0] == "train" and keys[1] in MOVED:
        new = ["train", MOVED[keys[1]], *keys[1:]]
    if len(new) == 4 and new[:2] == ["train", "launch"] and new[2] in ("slurm", "kubernetes") and new[3] in WAIT_FIELDS:
        new = ["train", "launch", "wait", new[3]]
    if new != keys:
        deprecated(".".join(keys), ".".join(new))
    return new


class TrainConfig(_Section):
    seq_length: int = Field(128, ge=8)
    micro_batch_size: int = Field(8, ge=1)
    global_batch_size: int = Field(8, ge=1)
    train_iters: int = Field(200, ge=1, description="The run's length in optimizer steps (or give train.epochs).")
    epochs: float | None = Field(
        None,
        gt=0.0,
        json_schema_extra=IF_SET,  # replaced by train_iters once the data is prepared, before the run is named
        description="The run's length in passes over the unique training tokens (the data.unique_tokens subset, "
        "or the whole split), instead of train_iters: train_iters = ceil(epochs x unique tokens / "
        "(global_batch_size x seq_length)), set after data prep.",
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, json_schema_extra=FLATTEN)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, json_schema_extra=FLATTEN)
    faults: FaultsConfig = Field(default_factory=FaultsConfig, json_schema_extra=OPERATIONAL)
    seed: int = 1234
    log_interval: int = Field(10, ge=1)
    eval_interval: int = Field(50, ge=1)
    eval_iters: int = Field(4, ge=1)
    init_from: str | None = Field(
        None,
        description="Megatron checkpoint (model weights, any TP/PP) to start from, e.g. from "
        "`difflm convert HF_DIR --out CKPT`. The optimizer starts fresh.",
    )
    init_from_hf: str | None = Field(
        None,
        json_schema_extra=IF_SET,  # the import replaces it by `init_from` = its checkpoint before the run is named
        description="A pretrained model's Hugging Face folder to start from (the flows: `difflm run`, adapt-difflm): "
        "imported once into <workdir>/imports/, then trained from as `init_from`; its architecture and tokenizer "
        "are the model's.",
    )
    precision: Literal["fp32", "bf16"] = Field("fp32", description="bf16: bf16 params/compute, fp32 main weights.")
    fp8: Literal["hybrid", "e4m3"] | None = Field(None, description="FP8 recipe (Transformer Engine on GPU only).")
    torch_threads: int | None = Field(None, ge=1, description="Intra-op threads per rank (None: cores / ranks).")
    peak_tflops: float | None = Field(
        None,
        gt=0.0,
        json_schema_extra=OPERATIONAL,
        description="Peak dense bf16 TFLOP/s of one device for MFU (None: looked up by device name "
        "in models/megatron/flops.py; MFU is not reported for an unknown device or the CPU).",
    )
    launch: LaunchConfig = Field(default_factory=LaunchConfig, json_schema_extra=FLATTEN)

    @model_validator(mode="before")
    @classmethod
    def _flat_spelling_of_before(cls, data: Any) -> Any:
        return nest_train_fields(data) if isinstance(data, dict) else data

    @model_validator(mode="before")
    @classmethod
    def _hf_folder_as_init_from(cls, data: Any) -> Any:
        """`init_from=<an HF folder>`, its meaning before `init_from_hf` existed, still works for a release."""
        if isinstance(data, dict) and is_hf_folder(data.get("init_from")) and not data.get("init_from_hf"):
            warnings.warn(
                "train.init_from=<a Hugging Face folder> is deprecated: use train.init_from_hf (train.init_from "
                "is a megatron checkpoint)",
                DeprecationWarning,
                stacklevel=2,
            )
            data = {**data, "init_from": None, "init_from_hf": data["init_from"]}
        return data

    @model_validator(mode="after")
    def _one_length(self) -> TrainConfig:
        # with epochs, train_iters holds its default until the data is prepared: a config written out then (the
        # Prefect parameter, `difflm config show`) reads back with both keys
        placeholder = self.train_iters == type(self).model_fields["train_iters"].default
        if self.epochs is not None and "train_iters" in self.model_fields_set and not placeholder:
            raise ValueError(
                f"train.train_iters ({self.train_iters}) and train.epochs ({self.epochs}) are both set: the run's "
                "length is one of them; remove one (an override of either replaces a preset's)"
            )
        return self

    @model_validator(mode="after")
    def _schedule(self) -> TrainConfig:
        warmup = self.schedule.warmup_iters
        if self.epochs is None and warmup >= self.train_iters:  # with epochs: checked once the length is known
            raise ValueError(
                f"warmup_iters ({warmup}) must be below train_iters ({self.train_iters}): set "
                f"train.schedule.warmup_iters too, e.g. train.schedule.warmup_iters={max(self.train_iters // 10, 0)}"
            )
        if self.schedule.min_lr > self.optimizer.lr:
            raise ValueError(f"min_lr ({self.schedule.min_lr}) must not exceed lr ({self.optimizer.lr})")
        return self


def iters_for_epochs(epochs: float, unique_tokens: int, global_batch_size: int, seq_length: int) -> int:
    """Optimizer steps that see `epochs` passes over `unique_tokens` (each step: global_batch_size sequences of
    seq_length tokens), rounded up; at least 1."""
    return max(1, math.ceil(epochs * unique_tokens / (global_batch_size * seq_length)))


def epochs_seen(iteration: int, unique_tokens: int, global_batch_size: int, seq_length: int) -> float:
    """Passes over the unique training tokens after `iteration` steps: tokens seen / unique tokens."""
    return iteration * global_batch_size * seq_length / max(unique_tokens, 1)
