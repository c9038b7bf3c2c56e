"""The `train` section: run length and numerics, with the optimizer, the schedule, the fault policy and the
launch as its sub-sections."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from difflm.config.base import IF_SET, OPERATIONAL, _Section
from difflm.config.launch import KubernetesLaunchConfig, SlurmLaunchConfig


def is_hf_folder(path: str | None) -> bool:
    """A Hugging Face model folder (config.json), not a megatron checkpoint (metadata.json)."""
    folder = Path(path).expanduser() if path else None
    return bool(folder) and (folder / "config.json").exists() and not (folder / "metadata.json").exists()


class TrainConfig(_Section):
    seq_length: int = Field(128, ge=8)
    micro_batch_size: int = Field(8, ge=1)
    global_batch_size: int = Field(8, ge=1)
    train_iters: int = Field(200, ge=1)
    lr: float = Field(3e-3, gt=0.0)
    min_lr: float = Field(3e-4, ge=0.0)
    warmup_iters: int = Field(20, ge=0)
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine",
        description="After warmup: cosine or linear decay to min_lr over the run, constant at lr, or "
        "wsd (warmup-stable-decay): constant at lr, then decay to min_lr over the last wsd_decay_fraction.",
    )
    wsd_decay_fraction: float = Field(0.2, gt=0.0, le=1.0, description="wsd: share of train_iters spent decaying.")
    wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = Field(
        "linear", description="wsd: shape of the final decay (megatron's lr_wsd_decay_style)."
    )
    on_nonfinite: Literal["skip", "stop"] = Field(
        "skip",
        json_schema_extra=OPERATIONAL,
        description="A NaN/Inf loss or gradient: skip the update and count it, or stop (the last good "
        "checkpoint is kept and the message names the step).",
    )
    max_nonfinite_skips: int = Field(
        10, ge=1, json_schema_extra=OPERATIONAL, description="Consecutive skipped steps before training stops anyway."
    )
    preempt_signals: list[Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"]] = Field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1"],
        json_schema_extra=OPERATIONAL,
        description="Signals on which the trainer finishes the "
        "current step, writes a checkpoint and exits as preempted (rerun / requeue resumes).",
    )
    weight_decay: float = Field(0.01, ge=0.0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.98, ge=0.0, lt=1.0)
    clip_grad: float = Field(1.0, ge=0.0)
    seed: int = 1234
    log_interval: int = Field(10, ge=1)
    eval_interval: int = Field(50, ge=1)
    eval_iters: int = Field(4, ge=1)
    nproc_per_node: int = Field(1, ge=1, description="torchrun processes per node (GPUs per node; CPU: gloo ranks).")
    nnodes: int = Field(1, ge=1, description="Nodes (cluster launches: `difflm launch`).")
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
    launcher: Literal["local", "slurm", "kubernetes"] = Field(
        "local",
        json_schema_extra=OPERATIONAL,
        description="Who runs torchrun. local: a subprocess here (one node); slurm: an sbatch job "
        "(train.slurm); kubernetes: a Kubeflow PyTorchJob (train.kubernetes). Cluster launchers write the same "
        "launch file as `difflm launch`, submit it, wait for the job and read the run directory, which must be "
        "on storage the nodes share. Operational: any launcher resumes any other's run.",
    )
    slurm: SlurmLaunchConfig = Field(default_factory=SlurmLaunchConfig, json_schema_extra=OPERATIONAL)
    kubernetes: KubernetesLaunchConfig = Field(default_factory=KubernetesLaunchConfig, json_schema_extra=OPERATIONAL)

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
    def _schedule(self) -> TrainConfig:
        if self.warmup_iters >= self.train_iters:
            raise ValueError(
                f"warmup_iters ({self.warmup_iters}) must be below train_iters ({self.train_iters}): set "
                f"train.warmup_iters too, e.g. train.warmup_iters={max(self.train_iters // 10, 0)}"
            )
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self
