"""The flagship flow `pretrain-difflm`: (the import of an HF source) -> data prep -> training (torchrun, Slurm or
Kubernetes) -> HF export -> evaluation -> registry. The stages are the rows of PRETRAIN_STAGES (`difflm.flows.stages`):
one MLflow run per execution with a nested run per stage; each stage cached by Prefect under the hash that names
its output; a markdown summary per stage as a Prefect artifact."""

from pathlib import Path

from prefect import flow, get_run_logger

from difflm import tracking
from difflm.config import PipelineConfig, load_config
from difflm.data_prep.pipeline import MANIFEST, data_dir
from difflm.flows.stages import Outcome, PipelineRun, Stage, run_stages, status
from difflm.manifest import DataManifest
from difflm.models.evaluation.record import EvalRecord
from difflm.models.hf.export import Export
from difflm.models.launch.torchrun import is_finished
from difflm.rundir import RunDir, TrainResult, Workdir, is_checkpoint, is_export_of
from difflm.tasks import adapt, artifacts
from difflm.tasks.cache import cache_key, eval_done, eval_key, mark_eval_done
from difflm.tasks.stages import convert_task, data_prep_task, evaluate_task, import_task, train_task

__all__ = ["PRETRAIN_STAGES", "Stage", "pretrain", "pretrain_difflm", "run_pipeline", "status"]


def resolve(config: PipelineConfig | dict | None, preset: str, overrides: list[str] | None) -> PipelineConfig:
    if config is not None:
        return config if isinstance(config, PipelineConfig) else PipelineConfig.model_validate(config)
    return load_config(preset, overrides or [])


@flow(name="pretrain-difflm", log_prints=True)
def pretrain_difflm(
    preset: str = "tiny-cpu",
    overrides: list[str] | None = None,
    config: PipelineConfig | None = None,
) -> dict:
    """Pretrain a diffusion LM end to end.

    Args:
        preset: a preset in configs/ or a YAML path (ignored when `config` is given).
        overrides: `section.field=value` overrides applied on top of the preset.
        config: a complete configuration (what the Prefect UI form edits).
    """
    return pretrain(resolve(config, preset, overrides), get_run_logger())


def pretrain(
    cfg: PipelineConfig,
    logger,
    parent: str | None = None,
    run_name: str = "",
    tags: dict | None = None,
    rows: list[Stage] | None = None,
) -> dict:
    """The flow's body: the pipeline (`rows`, default PRETRAIN_STAGES) in an MLflow run of its own, nested under
    `parent` when given (a study's point), named `run_name` (default: preset, mode and data), with more `tags`."""
    if cfg.train.init_from_hf:  # the model is the source's (the import checks every field)
        cfg = adapt.with_source(cfg)
    tags = {"preset": cfg.name, "mode": cfg.diffusion.model_running_mode, "flow": "pretrain-difflm", **(tags or {})}
    stages: dict[str, str] = {}
    run_name = run_name or f"{cfg.name}-{cfg.diffusion.model_running_mode}-{cfg.data_label()}"  # says which data
    with tracking.degradations() as degraded, tracking.pipeline_run(cfg, run_name, tags, parent=parent) as run_id:
        summary, _ = run_pipeline(cfg, run_id, logger, stages, rows=rows)
    summary["tracking"] = tracking.summary_line(degraded)  # this execution's (a study's points share a process)
    logger.info(f"pretrain-difflm finished ({', '.join(f'{k} {v}' for k, v in stages.items())}): {summary['hf_dir']}")
    return summary


def run_pipeline(
    cfg: PipelineConfig,
    run_id: str | None,
    logger,
    stages: dict[str, str],
    lineage: dict | None = None,
    rows: list[Stage] | None = None,
) -> tuple[dict, PipelineRun]:
    """The pipeline's `rows` (default PRETRAIN_STAGES) inside its MLflow run `run_id` (None: tracking off), then
    the registry. Returns (summary, the execution: the config trained, each stage's result) and records each
    stage's status in `stages`. `lineage`: the HF source's `difflm.tasks.adapt.source_lineage`, when the caller has it."""
    experiment_id = tracking.experiment_of(run_id)
    link = artifacts.mlflow_run_url(tracking.tracking_uri(cfg), experiment_id, run_id)
    # the view the printed link opens (the curves while it trains, too); None when it could not be stored
    shared = tracking.share_training_view(run_id) if run_id else None
    run = PipelineRun(cfg, run_id, link, stages, lineage=lineage)
    run_stages(run, PRETRAIN_STAGES if rows is None else rows)
    registered = _register(run, logger) if run_id else {}
    results, trained = run.results, run.trained
    summary = {
        "workdir": run.cfg.workdir,
        "data_dir": run.manifest.dir,
        # the unique training tokens and the epochs over them the run's steps make
        **{k.split(".")[1]: v for k, v in tracking.length_params(run.cfg, run.manifest.unique_tokens).items()},
        "run_dir": str(trained.run.path),
        "hf_dir": str(run.export.folder),
        "stages": stages,
        "mlflow_run_id": run_id,
        "mlflow_uri": tracking.tracking_uri(cfg) if run_id else None,
        "mlflow_run_url": link,
        "mlflow_curves_url": artifacts.mlflow_curves_url(tracking.tracking_uri(cfg), experiment_id, shared),
        "mlflow_experiment_id": experiment_id,
        "validation": results.bounds,
        "tasks": results.tasks,
        "report": results.report,
        "samples": results.samples,
        **registered,
    }
    return summary, run


def _register(run: PipelineRun, logger) -> dict:
    """The evaluation and stage statuses into the pipeline's MLflow run; the export registered (and promoted)."""
    tracking.log_evaluation(run.results.tracked())
    tracking.set_tags({f"stage.{k}": v for k, v in run.stages.items()})
    registered = (
        tracking.log_and_register_model(
            run.cfg,
            run.export.folder,
            run.run_id,
            str(run.trained.checkpoint),
            manifest=run.manifest,
            results=run.results.to_dict(),
            lineage=run.lineage,  # the source trained from (adapt, sft): its tags and description name it
        )
        or {}
    )
    if registered.get("version"):
        logger.info(
            f"registered {registered['registered_model']} v{registered['version']} by "
            f"{registered.get('registered_by', 'unknown')}: {registered['promotion']}"
        )
    return registered


# ---- the rows ----------------------------------------------------------------------------------------------


def _import_output(run: PipelineRun) -> Path:
    """<workdir>/imports/<source>/megatron: the source's weights, imported once (the lineage is read here once)."""
    return Workdir.of(run.cfg).import_for(run.cfg, run.source_lineage()["sha256"]).checkpoint


def _source_tags(run: PipelineRun) -> dict:
    return {f"source.{k}": v for k, v in run.source_lineage().items()}


def _imported(run: PipelineRun, out: Outcome) -> None:
    """The rest of the pipeline trains from the imported checkpoint, reading data through its tokenizer."""
    if run.run_id:
        tracking.set_tags({"train.init_from": str(out.result.checkpoint), **_source_tags(run)})
    run.cfg = adapt.with_import(run.cfg, out.result)


def _data_stats(run: PipelineRun, out: Outcome) -> None:
    tracking.log_data_stats(out.result, context="output")


def _data_ready(run: PipelineRun, out: Outcome) -> None:
    """The run's length in steps, now that the unique training tokens are known (a length given as train.epochs);
    the data and the length into the parent run."""
    run.cfg = run.cfg.with_unique_tokens(run.manifest.unique_tokens)
    if run.run_id:
        tracking.log_data_stats(run.manifest)
        tracking.log_length(run.cfg, run.manifest.unique_tokens)


def _train_inputs(run: PipelineRun) -> None:
    if run.sid:
        tracking.log_data_stats(run.manifest)
        tracking.log_length(run.cfg, run.manifest.unique_tokens)


def _trained(run: PipelineRun, out: Outcome) -> None:
    """The training curves into the stage run: sent live unless it was cached or reused."""
    tracking.log_training(out.result, out.result.run.metrics(), live=not (out.cached or out.done))


def _parent_curves(run: PipelineRun, out: Outcome) -> None:
    """The parent's first charts: the training curves (and, later, the evaluation)."""
    if run.run_id:
        tracking.log_training(out.result, out.result.run.metrics(), live=out.sid is None)


def _training_summary(run: PipelineRun, out: Outcome) -> str:
    trained, uri = out.result, tracking.tracking_uri(run.cfg)
    curves = artifacts.mlflow_artifact_url(uri, run.run_id, "train/curves.png") if trained.run.curves.exists() else None
    return artifacts.training_markdown(trained, trained.run.metrics(), out.cached, curves)


def _evaluated(run: PipelineRun, out: Outcome) -> None:
    mark_eval_done(out.output, out.key)


IMPORT = Stage(
    "import",
    import_task,
    slot="imported",
    when=lambda run: run.cfg.train.init_from_hf is not None,
    output=_import_output,
    done=lambda run, out: is_checkpoint(out),
    args=lambda run, out, key: (run.cfg, str(adapt.source_folder(run.cfg)), str(out), run.lineage),
    read=lambda result: adapt.ImportedSource.read(result),
    tags=lambda run, out: {"checkpoint": out.result.checkpoint, **_source_tags(run)},
    after=_imported,
)
DATA_PREP = Stage(
    "data-prep",
    data_prep_task,
    slot="manifest",
    output=lambda run: data_dir(run.cfg),
    done=lambda run, out: (out / MANIFEST).exists(),
    args=lambda run, out, key: (run.cfg,),
    read=DataManifest.of,  # the record, or the dict a stage cached before it was typed stored
    log=_data_stats,
    after=_data_ready,
    summary=lambda run, out: artifacts.data_markdown(out.result, out.cached),
    title="data prep",
)
TRAIN = Stage(
    "train",
    train_task,
    slot="trained",
    output=lambda run: Workdir.of(run.cfg).run_for(run.cfg, run.manifest).path,
    done=lambda run, out: is_finished(run.cfg, RunDir(out)),
    # the trainer sends its metrics live to the stage's run (else the pipeline's)
    args=lambda run, out, key: (run.cfg, run.manifest, tracking.child_env(run.cfg, run.sid or run.run_id)),
    read=TrainResult.read,
    before=_train_inputs,
    log=_trained,
    after=_parent_curves,
    summary=_training_summary,
    title="training",
    system_metrics=True,
)
CONVERT = Stage(
    "convert",
    convert_task,
    slot="export",
    output=lambda run: run.trained.run.hf,
    done=lambda run, out: is_export_of(out, run.trained.checkpoint),
    key=lambda run, out: cache_key("convert", out, run.trained.checkpoint),
    args=lambda run, out, key: (run.cfg, run.manifest, run.trained),
    read=Export.of,  # an Export, or the folder's path a stage cached before it was typed stored
    tags=lambda run, out: {"export.hf_dir": str(out.result.folder), "train.checkpoint": run.trained.checkpoint},
    summary=lambda run, out: artifacts.conversion_markdown(out.result, out.cached),
    title="conversion",
)
EVALUATE = Stage(
    "evaluate",
    evaluate_task,
    slot="results",
    output=lambda run: run.trained.run.eval_dir(),  # the run's own data: <run>/eval
    done=lambda run, out: eval_done(out, eval_key(run.cfg, run.manifest, run.export.folder)),
    key=lambda run, out: eval_key(run.cfg, run.manifest, run.export.folder),
    args=lambda run, out, key: (run.cfg, run.manifest, str(run.export.folder), str(out), True, key),
    read=EvalRecord.of,  # an EvalRecord, or the dict a stage cached before it was typed stored
    log=lambda run, out: tracking.log_evaluation(out.result.tracked()),
    after=_evaluated,
    summary=lambda run, out: artifacts.evaluation_markdown(out.result, out.cached),
    title="evaluation",
)
# the import of an HF folder given as `train.init_from_hf` (first: it sets the tokenizer the data is
# read through) -> training -> HF export -> evaluation; the registry follows (`run_pipeline`)
PRETRAIN_STAGES = [IMPORT, DATA_PREP, TRAIN, CONVERT, EVALUATE]
