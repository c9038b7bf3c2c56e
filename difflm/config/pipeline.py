"""`PipelineConfig`, the whole tree, composed of the sections; the identity of each stage's output."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import (
    Field,
    SerializeAsAny,
    field_validator,
    model_validator,
)

from difflm.config.base import ConfigError, _identity, _Section
from difflm.config.concurrency import ConcurrencyConfig
from difflm.config.data import DataConfig, TokenizerConfig
from difflm.config.diffusion import (
    DEFAULT_MODE,
    FLAT_IDENTITY_DEFAULTS,
    DiffusionConfig,
    diffusion_model,
    diffusion_section,
    modes,
)
from difflm.config.evaluation import EvalConfig
from difflm.config.export import ExportConfig
from difflm.config.model import ModelConfig
from difflm.config.tracking import TrackingConfig
from difflm.config.train import TrainConfig, iters_for_epochs


class ParallelConfig(_Section):
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    use_distributed_optimizer: bool = Field(False, description="Shard optimizer state across data-parallel ranks.")
    sequence_parallel: bool = Field(False, description="Split activations along the sequence across TP ranks.")


class CheckpointConfig(_Section):
    save_interval: int = Field(100, ge=1, description="Save a megatron distributed checkpoint every N iters.")
    keep_last: int = Field(2, ge=1, description="Keep the newest N intermediate checkpoints.")


class PipelineConfig(_Section):
    name: str = "tiny-cpu"
    workdir: str = Field(".difflm", description="Where every stage writes (data, runs, MLflow, Prefect state).")

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value: str) -> str:
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError(f"{value!r} contains a control character (a newline?): give a plain path")
        return value

    data: DataConfig = Field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    diffusion: SerializeAsAny[DiffusionConfig] = Field(
        default_factory=lambda: diffusion_model(DEFAULT_MODE)(),
        description="The objective's settings: those of model_running_mode's member (models/diffusion/modes.py) "
        "plus the shared ones.",
    )

    @field_validator("diffusion", mode="before")
    @classmethod
    def _diffusion_member(cls, value: Any) -> Any:
        return diffusion_section(value)

    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    pipeline: ConcurrencyConfig = Field(default_factory=ConcurrencyConfig)

    @model_validator(mode="after")
    def _parallel_layout(self) -> PipelineConfig:
        p, t, m = self.parallel, self.train, self.model
        model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        world = t.launch.nproc_per_node * t.launch.nnodes
        if world % model_parallel:
            raise ValueError(
                f"train.launch.nproc_per_node x nnodes ({world}) must be a multiple of tensor x pipeline parallel size ({model_parallel})"
            )
        dp = world // model_parallel
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise ValueError(
                f"train.global_batch_size ({t.global_batch_size}) must be a multiple of micro_batch_size x data-parallel size ({t.micro_batch_size * dp})"
            )
        if m.num_attention_heads % p.tensor_model_parallel_size:
            raise ValueError("model.num_attention_heads must be divisible by parallel.tensor_model_parallel_size")
        if p.sequence_parallel and p.tensor_model_parallel_size == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tensor_model_parallel_size > 1")
        if p.sequence_parallel and t.seq_length % p.tensor_model_parallel_size:
            raise ValueError("train.seq_length must be divisible by tensor_model_parallel_size with sequence_parallel")
        if m.num_layers % p.pipeline_model_parallel_size:
            raise ValueError("model.num_layers must be divisible by parallel.pipeline_model_parallel_size")
        return self

    @model_validator(mode="after")
    def _budget_holds_a_sample(self) -> PipelineConfig:
        budget, seq = self.data.unique_tokens, self.train.seq_length
        if budget is not None and budget <= seq:
            raise ValueError(
                f"data.unique_tokens ({budget}) must exceed train.seq_length ({seq}): a sample is seq_length + 1 tokens"
            )
        return self

    @model_validator(mode="after")
    def _engine_formats(self) -> PipelineConfig:
        """An engine layout the mode has none of is refused before training, not after (the architecture's fit is
        checked by the export itself: models/hf/engines.py)."""
        cls = modes().objective_class(self.diffusion.model_running_mode)
        takes = ", ".join(f"{c.engine_layout} ({c.name})" for c in modes().MODES.values() if c.engine_layout)
        for fmt in self.export.formats:
            if cls.engine_layout is None or fmt not in ("gguf", cls.engine_layout):
                fits = "" if cls.engine_layout is None else f"; this mode's is {cls.engine_layout} (or gguf)"
                raise ValueError(
                    f"export.formats: {fmt} cannot hold a {cls.name} model ({takes}{fits}); remove it from export.formats"
                )
        return self

    @model_validator(mode="after")
    def _objective_and_model(self) -> PipelineConfig:
        d = self.diffusion
        modes().objective_class(d.model_running_mode).check_model(
            self.model.backend, d.time_embedding, d.attention_anneal_steps
        )
        return self

    # ---- identity of stage outputs -------------------------------------------------------------
    def identity(self, section: str) -> dict[str, Any]:
        """The fields of `section` that name its stage's output directory: all but the OPERATIONAL ones."""
        if section == "diffusion":  # the settings every mode's name held before the per-mode sections
            return {**FLAT_IDENTITY_DEFAULTS, **_identity(self.diffusion)}
        if section == "data" and self.data.unique_tokens is None:  # the subset's salt, without a subset: no data
            return {k: v for k, v in _identity(self.data).items() if k != "subset_seed"}
        return _identity(getattr(self, section))

    def stage_hash(self, *sections: str) -> str:
        """A short content hash of the identity fields of the named sections: a stage's output directory name."""
        payload = {s: self.identity(s) for s in sections}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]

    def without_budget(self) -> PipelineConfig:
        """This config on the whole training split (data.unique_tokens and its seed unset): the data prep a budget
        is cut from."""
        whole = self.data.model_copy(
            update={"unique_tokens": None, "subset_seed": DataConfig.model_fields["subset_seed"].default}
        )
        return self.model_copy(update={"data": whole})

    def with_unique_tokens(self, unique_tokens: int) -> PipelineConfig:
        """This config with its length in steps: train.epochs over `unique_tokens` (the prepared training split's
        tokens) becomes train.train_iters, before the run is named; unchanged when train_iters is the length."""
        t = self.train
        if t.epochs is None:
            return self
        iters = iters_for_epochs(t.epochs, unique_tokens, t.global_batch_size, t.seq_length)
        if t.schedule.warmup_iters >= iters:
            raise ConfigError(
                f"train.epochs={t.epochs:g} over {unique_tokens:,} unique tokens is {iters} steps of "
                f"{t.global_batch_size} x {t.seq_length} tokens: train.schedule.warmup_iters "
                f"({t.schedule.warmup_iters}) must be below that; lower it or raise train.epochs"
            )
        train = t.model_copy(update={"train_iters": iters, "epochs": None})
        return self.model_copy(update={"train": train})

    def data_label(self) -> str:
        """Which data, in words, for names people read (registered model, MLflow runs): the sources' labels. The
        data hash (`data.hash` tags) says exactly which, tokenizer included."""
        return "+".join(s.label for s in self.data.sources)

    def flat(self) -> dict[str, Any]:
        """`section.field -> value`, the form MLflow params take."""
        out: dict[str, Any] = {}

        def walk(prefix: str, obj: Any) -> None:
            if isinstance(obj, dict):
                for k, v in obj.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = obj

        walk("", self.model_dump(mode="json"))
        if self.train.epochs is not None:  # the length is train.epochs; train_iters is known after data prep
            out.pop("train.train_iters")
        return out
