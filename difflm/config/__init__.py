"""The one typed configuration of the pipeline.

The same tree is the CLI's input (a YAML preset plus ``key.sub=value`` overrides), the Prefect flow's
parameter, the file handed to ``torchrun`` and the MLflow params. Every stage reads only its own
sections, and each stage's output directory is named by a hash of the sections it depends on.

One module per section group: `base` (the section class, run identity, ConfigError), `data`, `model`,
`diffusion`, `train`, `launch`, `evaluation`, `tracking`, `pipeline` (the whole tree), `loading` (presets,
overrides, validation) and `study` (a grid of pipeline runs). Every public name is importable from `difflm.config`.
"""

from difflm.config.base import FLATTEN, IF_SET, OPERATIONAL, ConfigError, deprecated, is_flattened, is_identity
from difflm.config.concurrency import ConcurrencyConfig
from difflm.config.data import DataConfig, SourceConfig, TokenizerConfig
from difflm.config.diffusion import (
    DEFAULT_MODE,
    FLAT_IDENTITY_DEFAULTS,
    DiffusionConfig,
    diffusion_model,
    diffusion_section,
    with_mode,
)
from difflm.config.evaluation import FLAT_SAMPLER_FIELDS, EvalConfig, SamplerConfig, nest_sampler_fields
from difflm.config.export import ExportConfig
from difflm.config.launch import (
    PARTITION,
    SBATCH_KEY,
    SBATCH_VALUE,
    SLURM_TIME,
    JobWaitConfig,
    KubernetesLaunchConfig,
    LaunchConfig,
    SlurmBase,
    SlurmConfig,
    SlurmLaunchConfig,
    shell_safe_problem,
)
from difflm.config.loading import (
    CONFIG_DIR,
    apply_overrides,
    load_config,
    parse_override,
    read_yaml,
    resolve_preset,
    safe_load,
    save_config,
    short_repr,
    validate,
)
from difflm.config.model import GEMM_TILE, GPU_WIDTH, MODEL_PRESETS, ModelConfig
from difflm.config.pipeline import CheckpointConfig, ParallelConfig, PipelineConfig
from difflm.config.study import Point, StudySpec, load_study, study_spec
from difflm.config.tracking import TrackingConfig
from difflm.config.train import FaultsConfig, OptimizerConfig, ScheduleConfig, TrainConfig, is_hf_folder

__all__ = [
    "ConcurrencyConfig",
    "CONFIG_DIR",
    "DEFAULT_MODE",
    "FLAT_IDENTITY_DEFAULTS",
    "FLAT_SAMPLER_FIELDS",
    "FLATTEN",
    "GEMM_TILE",
    "GPU_WIDTH",
    "IF_SET",
    "MODEL_PRESETS",
    "OPERATIONAL",
    "PARTITION",
    "SBATCH_KEY",
    "SBATCH_VALUE",
    "SLURM_TIME",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DiffusionConfig",
    "EvalConfig",
    "ExportConfig",
    "FaultsConfig",
    "JobWaitConfig",
    "KubernetesLaunchConfig",
    "LaunchConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PipelineConfig",
    "SamplerConfig",
    "ScheduleConfig",
    "SlurmBase",
    "SlurmConfig",
    "SlurmLaunchConfig",
    "SourceConfig",
    "TokenizerConfig",
    "TrackingConfig",
    "TrainConfig",
    "apply_overrides",
    "deprecated",
    "diffusion_model",
    "diffusion_section",
    "is_flattened",
    "is_hf_folder",
    "is_identity",
    "load_config",
    "nest_sampler_fields",
    "parse_override",
    "read_yaml",
    "resolve_preset",
    "safe_load",
    "short_repr",
    "Point",
    "StudySpec",
    "load_study",
    "study_spec",
    "save_config",
    "shell_safe_problem",
    "validate",
    "with_mode",
]
