"""The `evaluate` flow: score an export, a run directory or a registered MLflow model version on the
config's held-out data (bound, tasks, samples, optional sampler sweep), tracked in its own MLflow run."""

from pathlib import Path
from typing import Optional

from prefect import flow

from difflm import tracking
from difflm.config import PipelineConfig
from flows.pretrain import resolve
from models.evaluation.sources import resolve_export
from models.evaluation.stages import default_out_dir
from tasks import artifacts
from tasks.stages import data_prep_task, evaluate_task, sweep_task


@flow(name="evaluate", log_prints=True)
def evaluate(
    source: str,
    preset: str = "tiny-cpu",
    overrides: Optional[list[str]] = None,
    config: Optional[PipelineConfig] = None,
    out_dir: Optional[str] = None,
) -> dict:
    """Evaluate a model on the held-out split of the config's data.

    Args:
        source: an export folder, a run directory, or models:/<name>/<version> (or models:/<name>@<alias>).
        preset: a preset in configs/ or a YAML path (ignored when `config` is given): the data to score on.
        overrides: `section.field=value` overrides (eval.* sets tasks, samples, the sampler, and the device and
            dtype: eval.device=auto, eval.dtype=auto run on the GPU in bf16 when there is one).
        config: a complete configuration.
        out_dir: where results go (default: <run>/eval, or <workdir>/evals/<source>).
    """
    cfg = resolve(config, preset, overrides)
    manifest = data_prep_task(cfg)
    hf_dir = resolve_export(source, tracking.tracking_uri(cfg))
    out = Path(out_dir) if out_dir else default_out_dir(cfg, source, hf_dir)
    tags = {"flow": "evaluate", "source": source, "data.hash": manifest["hash"]}
    with tracking.pipeline_run(cfg, f"evaluate-{out.parent.name if out.name == 'eval' else out.name}", tags) as run_id:
        results = evaluate_task(cfg, manifest, str(hf_dir), str(out), untrained=False)
        results["sweep"] = sweep_task(cfg, manifest, str(hf_dir), str(out))
        if run_id:
            tracking.log_evaluation(results)
            tracking.log_sweep(results["sweep"], out / "sweep.png")
            tracking.log_data_stats(manifest, context="evaluation")
        link = artifacts.mlflow_run_url(tracking.tracking_uri(cfg), tracking.experiment_of(run_id), run_id)
    artifacts.publish("evaluate-summary", artifacts.evaluation_markdown(results), f"evaluation of {source}", link)
    results["mlflow_run_id"] = run_id
    results["out_dir"] = str(out)
    return results
