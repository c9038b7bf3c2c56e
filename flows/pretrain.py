"""The flagship flow `pretrain-difflm`: data prep -> training (torchrun, Slurm or Kubernetes) -> HF export ->
evaluation. One MLflow run per execution with a nested run per stage; each stage cached by Prefect under the
hash that names its output; a markdown summary per stage as a Prefect artifact."""

from pathlib import Path

from prefect import flow, get_run_logger

from data_prep.pipeline import MANIFEST, data_dir
from difflm import tracking
from difflm.config import PipelineConfig, load_config
from difflm.rundir import RunDir, is_export_of
from models.launch.torchrun import is_finished, read_metrics, run_dir
from tasks import adapt, artifacts
from tasks.cache import cache_key, eval_done, eval_key, mark_eval_done, run_stage
from tasks.stages import convert_task, data_prep_task, evaluate_task, import_task, train_task


def status(cached: bool, done: bool) -> str:
    """What a stage did: `cached` (Prefect skipped it), `reused` (it found its finished output), or `ran`."""
    return "cached" if cached else "reused" if done else "ran"


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
    cfg = resolve(config, preset, overrides)
    if adapt.is_hf_folder(cfg.train.init_from):  # the model is the source's (the import checks every field)
        cfg = adapt.with_source(cfg)
    logger = get_run_logger()
    tracking.DEGRADED.clear()  # what tracking could not do in THIS execution
    tags = {"preset": cfg.name, "mode": cfg.diffusion.model_running_mode, "flow": "pretrain-difflm"}
    stages: dict[str, str] = {}
    run_name = f"{cfg.name}-{cfg.diffusion.model_running_mode}-{cfg.data_label()}"  # says which data
    with tracking.pipeline_run(cfg, run_name, tags) as run_id:
        summary, _, _ = run_pipeline(cfg, run_id, logger, stages)
    summary["tracking"] = "degraded: " + "; ".join(tracking.DEGRADED) if tracking.DEGRADED else "ok"
    logger.info(f"pretrain-difflm finished ({', '.join(f'{k} {v}' for k, v in stages.items())}): {summary['hf_dir']}")
    return summary


def run_pipeline(
    cfg: PipelineConfig, run_id: str | None, logger, stages: dict[str, str], lineage: dict | None = None
) -> tuple[dict, PipelineConfig, dict]:
    """The flagship's stages inside the pipeline's MLflow run `run_id` (None: tracking off): data prep -> the
    import of an HF folder given as `train.init_from` -> training -> HF export -> evaluation -> registry. Returns
    (summary, the config trained, manifest) and records ran/cached per stage in `stages`; adapt-difflm runs these
    stages too. `lineage`: the HF source's `tasks.adapt.source_lineage`, when the caller has it already."""
    experiment_id = tracking.experiment_of(run_id)
    link = artifacts.mlflow_run_url(tracking.tracking_uri(cfg), experiment_id, run_id)
    # the view the printed link opens (the curves while it trains, too); None when it could not be stored
    shared = tracking.share_training_view(run_id) if run_id else None
    if adapt.is_hf_folder(cfg.train.init_from):  # a pretrained model's HF folder: its weights and tokenizer first
        cfg = _import_init(cfg, run_id, stages, lineage)

    ddir = data_dir(cfg)
    with tracking.stage_run("data-prep") as sid:
        done = (ddir / MANIFEST).exists()
        manifest, cached = run_stage(data_prep_task, cache_key("data-prep", ddir), done, cfg)
        tracking.log_stage(sid, cached)
        if sid:
            tracking.log_data_stats(manifest, context="output")
    stages["data-prep"] = status(cached, done)
    artifacts.publish("data-prep-summary", artifacts.data_markdown(manifest, cached), "data prep", link)
    if run_id:
        tracking.log_data_stats(manifest)

    rdir = run_dir(cfg, manifest)
    trained = is_finished(cfg, rdir)  # nothing to sample, nothing sent live: the stage will only reuse it
    with tracking.stage_run("train", system_metrics=cfg.tracking.system_metrics and not trained) as sid:
        if sid:
            tracking.log_data_stats(manifest)
        train_info, cached = run_stage(
            train_task, cache_key("train", rdir), trained, cfg, manifest, tracking.child_env(cfg, sid or run_id)
        )
        records = read_metrics(train_info["run_dir"])
        tracking.log_stage(sid, cached)
        if sid:
            tracking.log_training(train_info, records, live=not (cached or trained))
    stages["train"] = status(cached, trained)
    if run_id:  # the parent's first charts: the training curves (and, below, the evaluation)
        tracking.log_training(train_info, records, live=sid is None)
    curves = (
        artifacts.mlflow_artifact_url(tracking.tracking_uri(cfg), run_id, "train/curves.png")
        if RunDir(train_info["run_dir"]).curves.exists()
        else None
    )
    artifacts.publish(
        "train-summary", artifacts.training_markdown(train_info, records, cached, curves), "training", link
    )

    hf_path = RunDir(train_info["run_dir"]).hf
    with tracking.stage_run("convert") as sid:
        done = is_export_of(hf_path, train_info["checkpoint"])
        hf_dir, cached = run_stage(
            convert_task,
            cache_key("convert", hf_path, train_info["checkpoint"]),
            done,
            cfg,
            manifest,
            train_info,
        )
        tracking.log_stage(sid, cached, **{"export.hf_dir": hf_dir, "train.checkpoint": train_info["checkpoint"]})
    stages["convert"] = status(cached, done)
    artifacts.publish(
        "convert-summary",
        artifacts.conversion_markdown(hf_dir, train_info["checkpoint"], cached),
        "conversion",
        link,
    )

    key = eval_key(cfg, manifest, hf_dir)
    out_dir = RunDir(train_info["run_dir"]).eval_dir()  # the run's own data: <run>/eval
    with tracking.stage_run("evaluate") as sid:
        done = eval_done(out_dir, key)
        results, cached = run_stage(evaluate_task, key, done, cfg, manifest, hf_dir, str(out_dir), reuse_key=key)
        mark_eval_done(out_dir, key)
        tracking.log_stage(sid, cached)
        if sid:
            tracking.log_evaluation(results)
    stages["evaluate"] = status(cached, done)
    artifacts.publish("evaluate-summary", artifacts.evaluation_markdown(results, cached), "evaluation", link)
    registered = {}
    if run_id:
        tracking.log_evaluation(results)
        tracking.set_tags({f"stage.{k}": v for k, v in stages.items()})
        registered = (
            tracking.log_and_register_model(
                cfg, hf_dir, run_id, train_info["checkpoint"], manifest=manifest, results=results
            )
            or {}
        )
        if registered.get("version"):
            logger.info(
                f"registered {registered['registered_model']} v{registered['version']}: {registered['promotion']}"
            )
    summary = {
        "workdir": cfg.workdir,
        "data_dir": manifest["dir"],
        "run_dir": train_info["run_dir"],
        "hf_dir": hf_dir,
        "stages": stages,
        "mlflow_run_id": run_id,
        "mlflow_uri": tracking.tracking_uri(cfg) if run_id else None,
        "mlflow_run_url": link,
        "mlflow_curves_url": artifacts.mlflow_curves_url(tracking.tracking_uri(cfg), experiment_id, shared),
        "mlflow_experiment_id": experiment_id,
        "validation": results["bounds"],
        "tasks": results["tasks"],
        "report": results.get("report"),
        "samples": results["samples"],
        **registered,
    }
    return summary, cfg, manifest


def _import_init(cfg: PipelineConfig, run_id, stages: dict, lineage: dict | None) -> PipelineConfig:
    """`cfg` starting from the megatron checkpoint of the HF folder in `train.init_from` (imported once under
    <workdir>/imports/, `tasks.adapt.import_dir`) and reading data through the tokenizer the import prepared; the
    MLflow run names the source (tags `source.*`)."""
    folder = Path(cfg.train.init_from).expanduser().resolve()
    lineage = lineage or adapt.source_lineage(folder)
    ckpt_dir = adapt.import_dir(cfg, lineage) / "megatron"
    with tracking.stage_run("import") as sid:
        done = (ckpt_dir / "metadata.json").exists()
        ckpt, cached = run_stage(
            import_task,
            cache_key("import", ckpt_dir),
            done,
            cfg,
            str(folder),
            str(ckpt_dir),
        )
        tracking.log_stage(sid, cached, checkpoint=ckpt, **{f"source.{k}": v for k, v in lineage.items()})
    stages["import"] = status(cached, done)
    if run_id:
        tracking.set_tags({"train.init_from": ckpt, **{f"source.{k}": v for k, v in lineage.items()}})
    return adapt.with_import(cfg, Path(ckpt))
