"""The one typed configuration of the pipeline.

The same tree is the CLI's input (a YAML preset plus ``key.sub=value`` overrides), the Prefect flow's
parameter, the file handed to ``torchrun`` and the MLflow params. Every stage reads only its own
sections, and each stage's output directory is named by a hash of the sections it depends on.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import types
import typing
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from difflm.errors import UserError
from models.diffusion.modes import MODES, Objective, build_objective, objective_class

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


# Run identity, declared per field. Each stage's output directory is named by a hash of the sections it reads
# (`PipelineConfig.stage_hash`): every field is part of that name unless it is marked OPERATIONAL, i.e. it
# changes how a run is carried out (who launches it, how it reacts to faults) but not what it computes, so
# any setting of it resumes and reuses the same directory. A new field forks every existing run directory
# unless it is OPERATIONAL or IF_SET: tests/test_config.py lists the identity fields, so adding one is a decision.
# IF_SET marks an identity field added later whose default computes what runs made before it computed: it joins
# the name only when set to another value, so those runs keep their directories.
OPERATIONAL = {"identity": False}
IF_SET = {"identity": "if_set"}


def is_identity(field: FieldInfo) -> bool:
    """Whether a field is part of the name of its stage's output directory (see OPERATIONAL)."""
    extra = field.json_schema_extra
    return not (isinstance(extra, dict) and extra.get("identity") is False)


class _Section(BaseModel):
    # extra="forbid": a misspelt key is an error, not a silently ignored setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SourceConfig(_Section):
    path: str = Field(
        description="'demo:enwiki', a file, or a folder (JSONL[.gz|.zst], Parquet, .txt, saved HF dataset)."
    )
    format: Literal["auto", "jsonl", "parquet", "text", "hf_disk"] = "auto"
    text_key: str | None = Field(None, description="Field with the text (None: data.text_key).")
    weight: float | None = Field(
        None,
        gt=0.0,
        description="Share of this source in training (None: in proportion to its tokens, "
        "if every source leaves it unset; otherwise 1).",
    )
    name: str | None = Field(None, description="Name in outputs and the manifest (None: from the path).")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.path.startswith("demo:"):
            return self.path.split(":", 1)[1]
        return Path(self.path.rstrip("/")).name.split(".")[0] or "data"


# What may reach an sbatch script. Every value lands in a `#SBATCH --key=value` line, so a newline would start
# a shell line and whitespace would end the option: one token of these characters, validated here (a config
# error names the field) and checked again where the script is written (models/launch/cluster.py).
SBATCH_VALUE = re.compile(r"[\w.:,=@+/%&|!*\[\]()^-]*")
SBATCH_KEY = re.compile(r"[a-z][a-z0-9-]*")
PARTITION = re.compile(r"[\w.,-]+")
# Slurm's --time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds; or UNLIMITED / INFINITE
SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)


def shell_safe_problem(value: str) -> str | None:
    """Why `value` may not go into a generated script unquoted (a control character or whitespace), or None."""
    bad = [c for c in value if c.isspace() or ord(c) < 32 or ord(c) == 127]
    if bad:
        return f"contains {bad[0]!r} (no whitespace or control characters: the value goes into a job script)"
    return None


class SlurmBase(_Section):
    """What every Slurm job of the pipeline is given: the data-prep jobs (`data.slurm`) and training
    (`train.slurm`) add their own fields to these."""

    partition: str | None = Field(None, description="#SBATCH --partition (None: the cluster's default).")
    time: str = Field("04:00:00", description="#SBATCH --time: the time limit of one job.")
    sbatch_args: dict[str, str] = Field(
        default_factory=dict,
        description="More #SBATCH options, e.g. {account: proj, qos: high, cpus-per-task: '32', mem: 0}. "
        "One token each: no whitespace, quotes, '$', ';' or newlines.",
    )

    @field_validator("partition")
    @classmethod
    def _partition(cls, value: str | None) -> str | None:
        if value is not None and not PARTITION.fullmatch(value):
            raise ValueError(f"{value!r} is not a Slurm partition name (letters, digits, '_', '-', '.', ',')")
        return value

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, value: Any) -> Any:
        value = str(value) if isinstance(value, int) and not isinstance(value, bool) else value  # time=30: minutes
        if isinstance(value, str) and not SLURM_TIME.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Slurm time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED"
            )
        return value

    @field_validator("sbatch_args", mode="before")
    @classmethod
    def _sbatch_args(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        out = {}
        for key, val in value.items():
            key, val = str(key), "" if val is None else str(val)
            if not SBATCH_KEY.fullmatch(key.removeprefix("--")):
                raise ValueError(f"option {key!r} is not an sbatch option name (e.g. account, cpus-per-task)")
            if not SBATCH_VALUE.fullmatch(val):
                why = shell_safe_problem(val) or "contains a quote, '$', ';', '<', '>' or a backslash"
                raise ValueError(f"{key}={val!r} {why}: give one token, e.g. account=proj")
            out[key.removeprefix("--")] = val
        return out


class SlurmConfig(SlurmBase):
    """How data prep runs on Slurm (`data.executor=slurm`, datatrove's SlurmPipelineExecutor): one job array
    of data.tasks CPU jobs."""

    cpus_per_task: int = Field(1, ge=1)
    mem_per_cpu_gb: int = Field(2, ge=1)


class SlurmLaunchConfig(SlurmBase):
    """How training is submitted to Slurm: `train.launcher=slurm` and `difflm launch --target slurm`."""

    time: str = Field(
        "24:00:00",
        description="Time limit of one allocation; signal_seconds before it the job "
        "checkpoints and requeues itself, so a long run spans several allocations.",
    )
    signal_seconds: int = Field(
        120,
        ge=1,
        le=65535,
        description="#SBATCH --signal=B:USR1@N: how long before the time limit the job is told to checkpoint and "
        "requeue (Slurm checks time limits every 30 s and may signal up to 60 s earlier); leave the checkpoint "
        "time to save.",
    )
    gpus_per_node: int | None = Field(
        None,
        ge=0,
        description="#SBATCH --gpus-per-node (None: train.nproc_per_node; 0: no GPU request, for CPU nodes).",
    )
    python: str | None = Field(
        None,
        description="Python on the compute nodes, with this project installed (None: the interpreter "
        "that submits, which must then live on the filesystem the nodes share).",
    )
    poll_seconds: float = Field(30.0, gt=0.0, description="How often the launcher asks squeue about the job.")
    wait_hours: float | None = Field(
        None,
        gt=0.0,
        description="Stop waiting after this long (the job keeps running and a rerun reattaches "
        "to it); None: wait for as long as the job lasts, queueing and requeues included.",
    )


class KubernetesLaunchConfig(_Section):
    """How training is submitted to Kubernetes as a Kubeflow PyTorchJob: `train.launcher=kubernetes` and
    `difflm launch --target k8s`."""

    image: str = Field("difflm-pipeline:latest", description="Container image with this project installed.")
    pvc: str = Field(
        "difflm-data", description="PersistentVolumeClaim holding the workdir (ReadWriteMany for several nodes)."
    )
    mount: str = Field(
        "/data",
        description="Where the pods mount the claim. The workdir must lie under it, and the worker that "
        "submits must see the claim at the same path (mount it there), so run directories have one name.",
    )
    namespace: str | None = Field(None, description="Namespace of the job (None: kubectl's current one).")
    gpus_per_pod: int | None = Field(
        None, ge=0, description="nvidia.com/gpu limit per pod (None: train.nproc_per_node; 0: none, CPU pods)."
    )
    poll_seconds: float = Field(30.0, gt=0.0, description="How often the launcher reads the job's status.")
    start_timeout_minutes: float | None = Field(
        60.0,
        gt=0.0,
        description="Fail when the job is not Running after this long (pods unschedulable, image "
        "not pulled); the job is left in place for `kubectl describe`. None: wait.",
    )
    wait_hours: float | None = Field(
        None,
        gt=0.0,
        description="Stop waiting after this long (the job keeps running and a rerun reattaches "
        "to it); None: wait for as long as the job lasts.",
    )


class DataConfig(_Section):
    sources: list[SourceConfig] = Field(
        default_factory=lambda: [SourceConfig(path="demo:enwiki")],
        description="Inputs; a plain string is a path with defaults.",
    )
    text_key: str = Field("text", description="Default field holding the document text.")
    max_documents: int | None = Field(None, ge=1, description="Read at most this many documents per source.")
    min_chars: int = Field(0, ge=0, description="Drop documents shorter than this (0: off; empty ones always go).")
    max_chars: int | None = Field(None, ge=1, description="Drop documents longer than this (None: off).")
    dedup: bool = Field(False, description="Remove exact-duplicate documents.")
    strict: bool = Field(
        False,
        description="Fail on a damaged or unreadable input file (truncated/corrupt .gz/.zst, I/O error) "
        "instead of keeping its readable records; reads every input once more, up front, before any work.",
    )
    unicode_normalization: Literal["NFC", "NFKC"] | None = Field(None, description="Normalise text (None: off).")
    valid_fraction: float = Field(0.05, ge=0.0, lt=0.5, description="Share of documents held out for validation.")
    test_fraction: float = Field(0.0, ge=0.0, lt=0.5, description="Share of documents held out for test.")
    split_seed: int = Field(0, description="Salt of the document hash that assigns splits.")
    tasks: int | None = Field(None, ge=1, description="Output shards per (split, source) (None: = workers).")
    workers: int = Field(1, ge=1, description="Parallel processes of the local executor.")
    executor: Literal["local", "slurm", "ray"] = "local"
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)

    @field_validator("sources", mode="before")
    @classmethod
    def _strings_are_paths(cls, v: Any) -> Any:
        if isinstance(v, (str, dict)):
            v = [v]
        return [{"path": x} if isinstance(x, str) else x for x in v]

    @model_validator(mode="after")
    def _unique_names(self) -> DataConfig:
        labels = [s.label for s in self.sources]
        if len(set(labels)) != len(labels):
            raise ValueError(f"data.sources: two sources share a name ({labels}); give each a distinct `name`")
        if not self.sources:
            raise ValueError("data.sources is empty: give at least one input")
        return self

    @property
    def num_tasks(self) -> int:
        return self.tasks or self.workers


class TokenizerConfig(_Section):
    path: str | None = Field(
        None, description="Local HF tokenizer folder or tokenizer.json; None trains a byte-level BPE on the corpus."
    )
    vocab_size: int = Field(4096, ge=300, description="Vocabulary size when training the BPE tokenizer.")
    mask_token: str = Field("<|mask|>", description="Token that masked diffusion corrupts to; must exist.")
    eos_token: str = Field("<|endoftext|>", description="Appended to every document.")
    pad_token: str = Field("<|pad|>")


# Architecture presets (`model.preset=125m`); fields set next to the preset override it. The GPU-sized ones
# (hidden >= GPU_WIDTH) give an FFN width that is a multiple of GEMM_TILE: 8/3*hidden rounded to 8 (5464 for the
# 1B) leaves partial GEMM tiles on every MLP matmul (+0.5-1 MFU point on a GPU).
GEMM_TILE = 128
GPU_WIDTH = 1024
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4},  # ~1M (+ embeddings)
    "small": {"num_layers": 6, "hidden_size": 256, "num_attention_heads": 4},  # ~5M
    "125m": {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12},
    "350m": {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "ffn_hidden_size": 2816},
    "1b": {
        "num_layers": 24,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_query_groups": 8,
        "ffn_hidden_size": 5632,
    },
    "3b": {
        "num_layers": 32,
        "hidden_size": 2560,
        "num_attention_heads": 32,
        "num_query_groups": 8,
        "ffn_hidden_size": 6912,
    },
    "7b": {
        "num_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_query_groups": 8,
        "ffn_hidden_size": 11008,
    },
}


class ModelConfig(_Section):
    preset: Literal["tiny", "small", "125m", "350m", "1b", "3b", "7b"] | None = Field(
        None, description="Architecture preset; fields given alongside override it."
    )
    backend: Literal["auto", "torch", "local", "te"] = Field(
        "auto",
        description="Layer spec. auto: 'te' on CUDA with Transformer Engine installed, else 'torch' (also on the "
        "CPU, where it gives the local spec's logits to ~1e-7 and trains faster). torch: megatron-core's layers with PyTorch scaled_dot_product_attention "
        "(flash/cuDNN kernels on GPUs; FlexAttention block masks for document_attention) and norms that support "
        "sequence parallelism. local: megatron-core's reference spec (unfused softmax). te: Transformer Engine "
        "(fused attention, fp8).",
    )
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = Field(
        "auto",
        json_schema_extra=OPERATIONAL,
        description="The torch backend's SDPA kernel. auto: PyTorch's choice (the trainer logs which); flash, "
        "cudnn, efficient (CUDA only) or math: forced around the forward and backward (an error if that kernel "
        "cannot take the inputs).",
    )
    fusions: Literal["auto", "off"] = Field(
        "auto",
        json_schema_extra=OPERATIONAL,
        description="auto: on CUDA, megatron's compiled SwiGLU (bias_activation_fusion), its native fused "
        "cross-entropy (bf16) and torch's fused AdamW; the CPU keeps the reference path. off: the reference path "
        "everywhere (the trainer logs the settings in use).",
    )
    num_layers: int = Field(2, ge=1)
    hidden_size: int = Field(64, ge=8)
    num_attention_heads: int = Field(4, ge=1)
    num_query_groups: int | None = Field(None, ge=1, description="GQA groups (None: as many as heads).")
    ffn_hidden_size: int | None = Field(None, ge=1, description="None: 4*hidden (or 8/3*hidden with a gated MLP).")
    gated_mlp: bool = Field(
        True,
        # its old name (model.swiglu) in the run-directory hash, so runs named before the rename keep their names
        serialization_alias="swiglu",
        description="A gated MLP: act(gate) * up ([gate; up] rows). Was model.swiglu (still accepted).",
    )
    activation: Literal["silu", "gelu", "gelu_tanh"] | None = Field(
        None,
        json_schema_extra=IF_SET,
        description="The MLP's activation; gelu_tanh: GELU's tanh approximation (Gemma). None: silu when gated "
        "(SwiGLU), else gelu.",
    )
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    norm_offset: Literal[0, 1] = Field(
        0,
        json_schema_extra=IF_SET,
        description="Norms scale by (norm_offset + w): 1 is Gemma's (1 + w) RMSNorm, weights stored zero-centred.",
    )
    embedding_scale: bool = Field(
        False, json_schema_extra=IF_SET, description="Token embeddings times sqrt(hidden_size) (Gemma)."
    )
    rotary_base: int = Field(10000, ge=1)
    qk_layernorm: bool = False
    tie_embeddings: bool = True
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    init_method_std: float = Field(0.02, gt=0.0)
    norm_epsilon: float = Field(1e-5, gt=0.0)
    qkv_bias: bool = Field(
        False, json_schema_extra=IF_SET, description="Biases on the Q, K and V projections (Qwen2); none elsewhere."
    )
    kv_channels: int | None = Field(
        None,
        ge=1,
        json_schema_extra=IF_SET,
        description="Width of one attention head (HF head_dim; Qwen3 sets it apart from hidden/heads). "
        "None: hidden_size / num_attention_heads.",
    )
    hf_architecture: Literal["llama", "qwen2", "qwen3", "mistral", "gemma"] | None = Field(
        None,
        json_schema_extra=OPERATIONAL,
        description="The stock transformers class an `ar` export takes (recorded by `difflm convert HF_DIR`); "
        "None: the class whose switches the model has (models/hf/architectures.py; Llama by default). Exports only: "
        "training is the same.",
    )
    document_attention: bool = Field(
        False, description="Packed documents attend only within themselves (explicit mask on the local spec)."
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and "swiglu" in data:  # the old name, accepted for one release
            data = {k: v for k, v in data.items() if k != "swiglu"} | {"gated_mlp": data["swiglu"]}
        if isinstance(data, dict) and data.get("activation") == ("silu" if data.get("gated_mlp", True) else "gelu"):
            data = {**data, "activation": None}  # the default pairing, spelt out: the same run, the same name
        if isinstance(data, dict) and data.get("preset") in MODEL_PRESETS:
            return {**MODEL_PRESETS[data["preset"]], **data}
        return data

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by num_query_groups ({groups})"
            )
        return self

    @field_validator("fusions", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _ffn_fills_gemm_tiles(self) -> ModelConfig:
        if self.hidden_size >= GPU_WIDTH and self.ffn_size % GEMM_TILE:
            warnings.warn(
                f"model.ffn_hidden_size={self.ffn_size} is not a multiple of {GEMM_TILE}: on GPUs every MLP matmul "
                f"leaves partial tiles; e.g. model.ffn_hidden_size={-(-self.ffn_size // GEMM_TILE) * GEMM_TILE}",
                stacklevel=2,
            )
        return self

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.gated_mlp:  # keeps the parameter count of a 4h GELU MLP, rounded to a multiple of 8
            return int(8 * self.hidden_size / 3 + 7) // 8 * 8
        return 4 * self.hidden_size


DEFAULT_MODE = "difflm-noshift"

# The identity of before the per-mode sections: every mode's run name held these settings of the flat section (at
# their defaults where the mode lacks them). Frozen, so those runs keep their directories; a setting added later
# is IF_SET or belongs to its mode alone.
FLAT_IDENTITY_DEFAULTS = {
    "eps": 1e-3,
    "loss_weighting": "inverse_t",
    "uniform_loss": "elbo",
    "normalize_by": "all_tokens",
}


class DiffusionConfig(_Section):
    """The settings every mode shares. The section a config holds is the member of its mode (`diffusion_model`):
    these plus the objective's own settings, declared once on its class in models/diffusion/modes.py."""

    model_running_mode: str = Field(
        DEFAULT_MODE,
        description="The objective, one of models/diffusion/modes.py's MODES: difflm-noshift (masked diffusion, "
        "LLaDA/MDLM), difflm-noshift-uniform (uniform-state, UDLM/DUO), difflm-shift (shifted masked diffusion to "
        "adapt AR checkpoints, DiffuLLaMA/Dream), ar (the causal baseline), difflm-block (block diffusion, BD3-LM).",
    )
    attention_anneal_steps: int = Field(
        0,
        ge=0,
        json_schema_extra=IF_SET,
        description="DiffuLLaMA's attention-mask annealing (arXiv 2410.17891): over the first N training steps "
        "attention goes from causal to full, a query seeing a later key with probability step / N (one "
        "Bernoulli mask per step, shared by the batch): step 0 is exactly causal, steps >= N exactly full. "
        "Validation uses full attention (the adapted model's). 0: off. Bidirectional modes only.",
    )
    antithetic_t: bool = Field(False, description="Stratify t across the global batch (lower-variance loss).")
    varilen_prob: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="difflm_varilen_prob: chance that a micro-batch trains on a random "
        "shorter length in [2, seq_length] (diffusion modes only; MegaDLMs' default is 0.01).",
    )
    time_embedding: bool = Field(False, description="difflm_time_embedding: condition the network on t.")
    time_conditioning: Literal["adaln", "input"] = Field(
        "adaln",
        description="How t enters when time_embedding is on. adaln: every layer norm is modulated by "
        "t (DiT-style, as UDLM/DUO; needs model.backend=torch or local: Transformer Engine fuses the norms into its layers); input: an MLP of t added to the token "
        "embeddings (the first layer only; any backend).",
    )

    @model_validator(mode="after")
    def _objective_checks(self) -> DiffusionConfig:
        if type(self) is not DiffusionConfig:  # a member: the objective's own checks of its settings
            build_objective(self)
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        if cls is not DiffusionConfig:
            return handler(core_schema)
        # the section as the form shows it: one member per mode, chosen by model_running_mode
        members = tuple(diffusion_model(mode) for mode in MODES)
        union = Annotated[typing.Union[members], Field(discriminator="model_running_mode")]  # noqa: UP007
        return handler(TypeAdapter(union).core_schema)


_MEMBERS: dict[type[Objective], type[DiffusionConfig]] = {}


def diffusion_model(mode: str) -> type[DiffusionConfig]:
    """The `diffusion` section of `mode`: the shared settings plus the objective class's own, built from its
    dataclass fields (default, `Literal` choices, and the metadata of `modes.setting`). Built on first use, so a
    mode registered in MODES later has its section too."""
    cls = objective_class(mode)
    member = _MEMBERS.get(cls)
    if member is None:
        hints = typing.get_type_hints(cls)
        own = {f.name: (hints[f.name], _setting_field(f)) for f in dataclasses.fields(cls) if f.name in cls.settings()}
        doc = (cls.__doc__ or "").split("\n\n")[0]
        kind = (Literal[mode], Field(mode, description=" ".join(doc.split())))
        name = "Diffusion" + "".join(part.title() for part in re.split(r"[^A-Za-z0-9]+", mode))
        member = pydantic.create_model(name, __base__=DiffusionConfig, model_running_mode=kind, **own)
        _MEMBERS[cls] = member
    return member


def _setting_field(f: dataclasses.Field) -> Any:
    meta = dict(f.metadata)
    identity = meta.pop("identity", None)
    extra = None if identity is None else {"identity": identity}
    if f.default_factory is not dataclasses.MISSING:
        return Field(default_factory=f.default_factory, json_schema_extra=extra, **meta)
    return Field(f.default, json_schema_extra=extra, **meta)


def diffusion_section(value: Any) -> Any:
    """A `diffusion` mapping as its mode's member. A setting of another mode is dropped at that mode's default (a
    run's config.yaml of before the per-mode sections holds every setting) and refused otherwise."""
    if type(value) is DiffusionConfig:  # the shared settings alone: the member of their mode
        value = value.model_dump()
    if not isinstance(value, dict):
        return value
    data = dict(value)
    mode = data.setdefault("model_running_mode", DEFAULT_MODE)
    if mode not in MODES:
        raise ValueError(f"diffusion.model_running_mode {mode!r} is not a mode: one of {', '.join(map(repr, MODES))}")
    member = diffusion_model(mode)
    for name in [n for n in data if n not in member.model_fields]:
        having = {m: c for m, c in MODES.items() if name in c.settings()}
        if not having:
            continue  # unknown everywhere: extra="forbid" names it, with a close match
        if any(data[name] == _default(c, name) for c in having.values()):
            del data[name]
            continue
        raise ValueError(
            f"diffusion.{name} is a setting of {', '.join(having)}; model_running_mode is {mode} "
            f"(switch the mode, or leave {name} out)"
        )
    return member.model_validate(data)


def _default(cls: type[Objective], name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def with_mode(cfg: PipelineConfig, mode: str, **settings: Any) -> PipelineConfig:
    """`cfg` training `mode`: the shared settings kept, the settings of the old mode that the new one lacks dropped,
    `settings` set."""
    member = diffusion_model(mode)
    data = {**cfg.diffusion.model_dump(), **settings, "model_running_mode": mode}
    diffusion = member.model_validate({k: v for k, v in data.items() if k in member.model_fields})
    return cfg.model_copy(update={"diffusion": diffusion})


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


class ParallelConfig(_Section):
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    use_distributed_optimizer: bool = Field(False, description="Shard optimizer state across data-parallel ranks.")
    sequence_parallel: bool = Field(False, description="Split activations along the sequence across TP ranks.")


class CheckpointConfig(_Section):
    save_interval: int = Field(100, ge=1, description="Save a megatron distributed checkpoint every N iters.")
    keep_last: int = Field(2, ge=1, description="Keep the newest N intermediate checkpoints.")


# The sampler's fields before eval.sampler existed (eval.<old> -> eval.sampler.<new>): still read, so the
# config.yaml of a run trained then loads as it was written.
FLAT_SAMPLER_FIELDS = {
    "sampler_steps": "steps",
    "block_length": "block_length",
    "remasking": "remasking",
    "threshold": "threshold",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "cfg_scale": "cfg_scale",
    "stop_at_eos": "stop_at_eos",
}


class SamplerConfig(_Section):
    """The masked-diffusion sampler (`eval.sampler`): exactly the fields of `models.diffusion.MaskedSampler`,
    which `models.evaluation.generation.sampler_settings` builds from it. ar decodes one token per step
    whatever `steps` says."""

    steps: int = Field(24, ge=1, description="Denoising steps (split across blocks; ignored with threshold).")
    block_length: int | None = Field(
        None, ge=1, description="Semi-autoregressive blocks of this many tokens (LLaDA); None: one block."
    )
    remasking: Literal["low_confidence", "margin", "entropy", "random"] = Field(
        "low_confidence", description="Which masked positions each step commits (confidence is untempered)."
    )
    threshold: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Fast-dLLM parallel decoding: commit "
        "every position more confident than this, at least one per step.",
    )
    temperature: float = Field(0.0, ge=0.0, description="0: greedy; >0: sample from softmax(logits/T).")
    top_k: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    cfg_scale: float = Field(
        0.0, ge=0.0, description="Classifier-free guidance (prompt masked for the unconditional pass); 0: off."
    )
    stop_at_eos: bool = Field(True, description="A row stops once it committed an EOS with nothing masked before it.")
    prefix_cache: bool = Field(
        False,
        description="Fast-dLLM's prefix KV cache for full-sequence masked models: the prompt's and finished blocks' "
        "keys and values are computed at each block's first step and reused for its other steps (approximate: "
        "bidirectional attention would update them; fewer model FLOPs per token). Block-diffusion models always "
        "use their exact cache.",
    )


def nest_sampler_fields(eval_section: dict[str, Any]) -> dict[str, Any]:
    """`eval` with the sampler's flat fields of before (eval.sampler_steps, eval.temperature, ...) moved into
    eval.sampler; a setting given both ways is an error naming the one spelling."""
    flat = {k: v for k, v in eval_section.items() if k in FLAT_SAMPLER_FIELDS}
    if not flat:
        return eval_section
    sampler = eval_section.get("sampler")
    sampler = dict(sampler) if isinstance(sampler, dict) else {}
    for old in flat:
        if FLAT_SAMPLER_FIELDS[old] in sampler:
            raise ValueError(
                f"eval.{old} is the old spelling of eval.sampler.{FLAT_SAMPLER_FIELDS[old]}, which "
                f"is also given: set only eval.sampler.{FLAT_SAMPLER_FIELDS[old]}"
            )
    sampler.update({FLAT_SAMPLER_FIELDS[k]: v for k, v in flat.items()})
    return {**{k: v for k, v in eval_section.items() if k not in flat}, "sampler": sampler}


class EvalConfig(_Section):
    max_sequences: int = Field(
        32,
        ge=1,
        description="Held-out windows of train.seq_length tokens (consecutive, across document "
        "boundaries) scored by the likelihood report.",
    )
    t_samples: int = Field(8, ge=1, description="Monte-Carlo noise levels per window for the ELBO.")
    num_samples: int = Field(3, ge=0, description="Texts generated by the diffusion sampler.")
    sample_length: int = Field(48, ge=1)
    sampler: SamplerConfig = Field(
        default_factory=SamplerConfig,
        description="The diffusion sampler of samples, generation and the steps sweep: MaskedSampler's own fields.",
    )
    prompts: list[str] = Field(
        default_factory=list,
        description="Prompts for samples (empty: the first words of held-out documents of the run's own data).",
    )
    prompt_words: int = Field(12, ge=1, description="Words of each held-out document used as a default prompt.")
    task_items: int = Field(
        64, ge=0, description="Items per task (cloze, choice) built from the held-out split; 0: no tasks."
    )
    mc_samples: int = Field(32, ge=1, description="Monte-Carlo draws of the conditional ELBO per task request.")
    steps_sweep: list[int] = Field(
        default_factory=list,
        description="Sampler steps to sweep in the evaluate flow (quality and speed against steps); empty: none.",
    )
    seed: int = 0
    device: str = Field(
        "auto",
        description="Where the export is evaluated (`difflm eval`, `difflm generate`, the evaluate flow). "
        "auto: CUDA (the current device) when torch sees a GPU, else the CPU; or cpu, cuda, cuda:<index>. "
        "Checked when the model is loaded, not here, so a config written on a GPU machine still loads on a laptop.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weights and activations of the evaluated model. auto: bfloat16 on CUDA (as LLaDA and "
        "Dream are evaluated), float32 on the CPU. The ELBO noise is drawn on the CPU, so only the model's "
        "arithmetic differs between dtypes and devices.",
    )

    @field_validator("device")
    @classmethod
    def _device_form(cls, v: str) -> str:
        # only the form: whether CUDA is there is a property of the machine that loads the model
        if v not in ("auto", "cpu", "cuda") and not (v.startswith("cuda:") and v[5:].isdigit()):
            raise ValueError(f"eval.device must be auto, cpu, cuda or cuda:<index>, not {v!r}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_documents" in data:
            raise ValueError(
                "eval.max_documents was renamed eval.max_sequences: it counts seq_length windows, "
                "not documents. Rename the key (same value)."
            )
        return nest_sampler_fields(data) if isinstance(data, dict) else data


class TrackingConfig(_Section):
    enabled: bool = True
    tracking_uri: str | None = Field(None, description="MLflow URI (None: sqlite store in the workdir).")
    experiment: str = "difflm"
    registry: bool = Field(
        True,
        description="Register the HF export as a version of a registered model "
        "(false: it is only logged as an artifact of the run).",
    )
    registered_model: str | None = Field(
        None,
        description="Registered model name (None: difflm-<preset name>-<mode>, so each preset and mode has "
        "its own model and champion; an empty string disables registration, as registry: false does).",
    )
    champion_metric: str = Field(
        "eval.trained.nll_per_token",
        description="Run metric that decides the `champion` alias: a new version "
        "takes it only when strictly better than the champion's (default: the validation ELBO/NLL in nats/token).",
    )
    champion_higher_is_better: bool = Field(
        False, description="True for scores (e.g. eval.cloze.acc); False for losses and bounds."
    )
    system_metrics: bool = Field(
        True,
        description="Sample CPU, memory, disk, network (and GPU) utilisation into the training stage's "
        "MLflow run while it trains (MLflow's system metrics, every 10 s).",
    )


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
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _parallel_layout(self) -> PipelineConfig:
        p, t, m = self.parallel, self.train, self.model
        model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        world = t.nproc_per_node * t.nnodes
        if world % model_parallel:
            raise ValueError(
                f"train.nproc_per_node x nnodes ({world}) must be a multiple of tensor x pipeline parallel size ({model_parallel})"
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
    def _objective_and_model(self) -> PipelineConfig:
        d = self.diffusion
        objective_class(d.model_running_mode).check_model(
            self.model.backend, d.time_embedding, d.attention_anneal_steps
        )
        return self

    # ---- identity of stage outputs -------------------------------------------------------------
    def identity(self, section: str) -> dict[str, Any]:
        """The fields of `section` that name its stage's output directory: all but the OPERATIONAL ones."""
        if section == "diffusion":  # the settings every mode's name held before the per-mode sections
            return {**FLAT_IDENTITY_DEFAULTS, **_identity(self.diffusion)}
        return _identity(getattr(self, section))

    def stage_hash(self, *sections: str) -> str:
        """A short content hash of the identity fields of the named sections: a stage's output directory name."""
        payload = {s: self.identity(s) for s in sections}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]

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
        return out


def _identity(section: BaseModel) -> dict[str, Any]:
    """`section` as JSON (`model_dump(mode="json")`), without the OPERATIONAL fields of it and of every section
    nested in it."""

    def prune(value: Any, dumped: Any) -> Any:
        if isinstance(value, BaseModel):
            return {
                field.serialization_alias or name: prune(getattr(value, name), dumped[name])
                for name, field in type(value).model_fields.items()
                if is_identity(field) and not (_if_set(field) and getattr(value, name) == field.default)
            }
        if isinstance(value, (list, tuple)):
            return [prune(v, d) for v, d in zip(value, dumped)]
        return dumped

    return prune(section, section.model_dump(mode="json"))


def _if_set(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("identity") == "if_set"


class ConfigError(UserError, ValueError):
    """An invalid configuration, with a message that names the field and what it accepts."""

    exit_code = 2  # a usage error, as argparse's


def _format_validation_error(err: ValidationError) -> str:
    lines = ["invalid configuration:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(e["loc"][-1]), _fields_at(e["loc"][:-1]), n=1, cutoff=0.6)
            hint = f"did you mean {'.'.join([*map(str, e['loc'][:-1]), close[0]])}? " if close else ""
            msg = f"unknown field ({hint}`difflm config show` lists every field)"
        got = e.get("input")
        lines.append(f"  {loc}: {msg}" + ("" if isinstance(got, dict) else f" (got {got!r})"))
    return "\n".join(lines)


def _fields_at(loc: tuple) -> list[str]:
    """The field names of the config section at `loc` (for "did you mean"); [] where loc is not a section. The
    `diffusion` section offers the settings of every mode."""
    model: type[BaseModel] = PipelineConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        ann = field.annotation
        if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union:  # X | None
            ann = next((a for a in typing.get_args(ann) if a is not type(None)), None)
        if typing.get_origin(ann) is Annotated:  # SerializeAsAny[X]
            ann = typing.get_args(ann)[0]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    if model is DiffusionConfig:
        return list(dict.fromkeys(name for mode in MODES for name in diffusion_model(mode).model_fields))
    return list(model.model_fields)


def read_yaml(path: Path) -> dict[str, Any]:
    """A preset or a run's config.yaml as a mapping; a YAML mistake is one line, `file:line:column: problem`."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        start = err.context_mark if err.context and err.problem else None
        context = f", {err.context} at {start.line + 1}:{start.column + 1}" if start else ""
        raise ConfigError(f"{where}: {err.problem or err.context}{context}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot be read ({err})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a preset is a mapping of sections (model:, train:, data:, ...), not a {type(data).__name__}"
        )
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a','b'], parsed value); values parse as YAML scalars (3, 1e-3, true, null, [a, b])."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, _, raw = text.partition("=")
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        return keys, yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        problem = str(err).splitlines()[0]
        raise ConfigError(
            f"override {text!r}: the value is not valid YAML ({problem}). Quote the whole override for the shell, "
            f'e.g. "data.sources=[{{path: a.jsonl}}, b/]"'
        ) from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    if isinstance(data.get("eval"), dict):  # written in the spelling of before (a run's own config.yaml)
        try:
            data["eval"] = nest_sampler_fields(data["eval"])
        except ValueError as err:
            raise ConfigError(str(err)) from None
    for text in overrides:
        keys, value = parse_override(text)
        if len(keys) == 2 and keys[0] == "eval" and keys[1] in FLAT_SAMPLER_FIELDS:  # eval.temperature=...
            keys = ["eval", "sampler", FLAT_SAMPLER_FIELDS[keys[1]]]
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {k!r} is not a section")
        node[keys[-1]] = value
    return data


def resolve_preset(preset: str) -> Path:
    """A preset name in configs/ or a path to a YAML file."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    candidate = CONFIG_DIR / f"{preset}.yaml"
    if candidate.exists():
        return candidate
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"no preset or YAML file {preset!r}; presets: {', '.join(known)}")


def load_config(preset: str | None = "tiny-cpu", overrides: list[str] | None = None) -> PipelineConfig:
    """Load a preset (name or YAML path), apply overrides, validate. Raises ConfigError before any work."""
    data: dict[str, Any] = {}
    if preset:
        data = read_yaml(resolve_preset(preset))
    data = apply_overrides(data, overrides or [])
    return validate(data)


def validate(data: dict[str, Any]) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def save_config(cfg: PipelineConfig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path
