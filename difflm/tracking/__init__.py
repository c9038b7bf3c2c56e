"""MLflow tracking, the model registry and plots: what a pipeline execution records.

- `mlflow_runs`: one MLflow run per execution, a nested run per stage, metrics, the model upload;
- `eval_runs`: an evaluation record and a sampler sweep in the run (params, metrics, samples, artifacts);
- `registry`: registered models, the `candidate` / `champion` aliases and the promotion rule;
- `plots`: loss curves and the sampler sweep (matplotlib, imported lazily);
- `latest`: where evaluate-latest's scores go (the training's MLflow run, else one of its own).

The names callers use are re-exported here (`from difflm import tracking; tracking.pipeline_run(...)`).
Patch `DEGRADED` on `difflm.tracking.degraded`, where `degrade` reads it.
"""

from difflm.tracking import registry
from difflm.tracking.degraded import DEGRADED, degradations, degrade, summary_line, tolerant
from difflm.tracking.eval_runs import log_evaluation, log_sweep
from difflm.tracking.latest import log_latest_score, training_mlflow_run
from difflm.tracking.mlflow_runs import (
    EXPERIMENT_KIND,
    child_env,
    data_counts,
    dataset,
    download_model_version,
    experiment_id,
    experiment_of,
    length_params,
    lineage_tags,
    log_and_register_model,
    log_data_stats,
    log_files,
    log_length,
    log_stage,
    log_text,
    log_training,
    pipeline_run,
    reconcile_metrics,
    set_tags,
    share_training_view,
    stage_run,
    study_run,
    tracking_uri,
    training_view,
    use_store,
)

__all__ = [
    "DEGRADED",
    "EXPERIMENT_KIND",
    "child_env",
    "data_counts",
    "dataset",
    "degradations",
    "degrade",
    "download_model_version",
    "experiment_id",
    "experiment_of",
    "lineage_tags",
    "log_and_register_model",
    "log_data_stats",
    "length_params",
    "log_evaluation",
    "log_files",
    "log_length",
    "log_stage",
    "log_sweep",
    "log_latest_score",
    "log_text",
    "log_training",
    "pipeline_run",
    "reconcile_metrics",
    "registry",
    "set_tags",
    "share_training_view",
    "stage_run",
    "study_run",
    "summary_line",
    "tolerant",
    "tracking_uri",
    "training_mlflow_run",
    "training_view",
    "use_store",
]
