"""The `evaluate` flow: score an export, a run directory or a registered MLflow model version on the held-out
data (bound, tasks, samples, optional sampler sweep), tracked in its own MLflow run. By default on the data and
config its run recorded; other data is explicit and its results go elsewhere (`difflm.tasks.sources.source_config`)."""

from pathlib import Path

from prefect import flow

from difflm import tracking
from difflm.config import PipelineConfig
from difflm.flows.pretrain import resolve
from difflm.models.evaluation.record import EvalRecord
from difflm.models.evaluation.sources import resolve_export
from difflm.models.evaluation.stages import default_out_dir
from difflm.rundir import RunDir
from difflm.tasks import artifacts
from difflm.tasks.sources import recorded_data, source_config
from difflm.tasks.stages import data_prep_task, evaluate_task, sweep_task


@flow(name="evaluate", log_prints=True)
def evaluate(
    source: str,
    preset: str | None = None,
    overrides: list[str] | None = None,
    config: PipelineConfig | None = None,
    out_dir: str | None = None,
) -> dict:
    """Evaluate a model on the held-out split of its run's data (or of the data the config names).

    Args:
        source: an export folder, a run directory, or models:/<name>/<version> (or models:/<name>@<alias>).
        preset: a preset in configs/ or a YAML path (ignored when `config` is given); empty: the config the
            source's run recorded (its data and tokenizer), else tiny-cpu.
        overrides: `section.field=value` overrides (eval.* sets tasks, samples, the sampler, and the device and
            dtype: eval.device=auto, eval.dtype=auto run on the GPU in bf16 when there is one; data.* scores on
            other data, read through the model's tokenizer).
        config: a complete configuration (replaces preset and overrides).
        out_dir: where results go (default: <run>/eval on the run's data, <run>/eval-<data hash> on other data,
            or <workdir>/evals/<source>).
    """
    named = resolve(config, preset or "tiny-cpu", overrides)
    hf_dir = resolve_export(source, tracking.tracking_uri(named), named.tracking)
    if config is not None:
        cfg, run = resolve(config, "tiny-cpu", None), RunDir.holding(hf_dir)
    else:
        cfg, run = source_config(hf_dir, preset, overrides)
    manifest = recorded_data(cfg, run) or data_prep_task(cfg)
    out = Path(out_dir) if out_dir else default_out_dir(cfg, source, hf_dir, manifest.hash)
    tags = {"flow": "evaluate", "source": source, "data.hash": manifest.hash}
    name = out.parent.name + out.name.removeprefix("eval") if run and out.parent == run.path else out.name
    with tracking.pipeline_run(cfg, f"evaluate-{name}", tags) as run_id:
        results = evaluate_task(cfg, manifest, str(hf_dir), str(out), untrained=False)
        sweep = sweep_task(cfg, manifest, str(hf_dir), str(out))
        if sweep:  # the record on disk gained the sweep and its AUP
            results = EvalRecord.read(out).replace(report=results.report)
        if run_id:
            tracking.log_evaluation(results.tracked())
            tracking.log_sweep(results.sweep or [], out / "sweep.png")
            tracking.log_data_stats(manifest, context="evaluation")
        link = artifacts.mlflow_run_url(tracking.tracking_uri(cfg), tracking.experiment_of(run_id), run_id)
    artifacts.publish("evaluate-summary", artifacts.evaluation_markdown(results), f"evaluation of {source}", link)
    # the flow's result (the CLI prints it, a deployment's run keeps it): the record's JSON and where it went
    return {**results.to_dict(), "mlflow_run_id": run_id, "out_dir": str(out)}
