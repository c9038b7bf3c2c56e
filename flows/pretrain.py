"""The flagship flow `pretrain-difflm`: data prep -> torchrun training -> HF export -> evaluation,
all tracked in one MLflow run with the model registered."""


from typing import Optional

from prefect import flow, get_run_logger

from difflm import tracking
from difflm.config import PipelineConfig, load_config
from models.launch.torchrun import read_metrics
from tasks.stages import convert_task, data_prep_task, evaluate_task, train_task


def resolve(config: PipelineConfig | dict | None, preset: str, overrides: list[str] | None) -> PipelineConfig:
    if config is not None:
        return config if isinstance(config, PipelineConfig) else PipelineConfig.model_validate(config)
    return load_config(preset, overrides or [])


@flow(name="pretrain-difflm", log_prints=True)
def pretrain_difflm(
    preset: str = "tiny-cpu",
    overrides: Optional[list[str]] = None,
    config: Optional[PipelineConfig] = None,
) -> dict:
    """Pretrain a diffusion LM end to end.

    Args:
        preset: a preset in configs/ or a YAML path (ignored when `config` is given).
        overrides: `section.field=value` overrides applied on top of the preset.
        config: a complete configuration (what the Prefect UI form edits).
    """
    cfg = resolve(config, preset, overrides)
    logger = get_run_logger()
    tracking.DEGRADED.clear()  # what tracking could not do in THIS execution
    tags = {"preset": cfg.name, "mode": cfg.diffusion.model_running_mode, "flow": "pretrain-difflm"}
    with tracking.pipeline_run(cfg, f"{cfg.name}-{cfg.diffusion.model_running_mode}", tags) as run_id:
        manifest = data_prep_task(cfg)
        if run_id:
            tracking.log_data_stats(manifest)
        train_info = train_task(cfg, manifest, tracking.child_env(cfg, run_id))
        if run_id:
            tracking.log_training(train_info, read_metrics(train_info["run_dir"]))
        hf_dir = convert_task(cfg, manifest, train_info)
        results = evaluate_task(cfg, manifest, hf_dir)
        registered = {}
        if run_id:
            tracking.log_evaluation(results)
            registered = tracking.log_and_register_model(cfg, hf_dir, run_id, train_info["checkpoint"],
                                                         manifest=manifest, results=results) or {}
            if registered.get("version"):
                logger.info(f"registered {registered['registered_model']} v{registered['version']}: "
                            f"{registered['promotion']}")
    summary = {
        "workdir": cfg.workdir,
        "data_dir": manifest["dir"],
        "run_dir": train_info["run_dir"],
        "hf_dir": hf_dir,
        "mlflow_run_id": run_id,
        "mlflow_uri": tracking.tracking_uri(cfg) if run_id else None,
        "validation": results["bounds"],
        "tasks": results["tasks"],
        "report": results.get("report"),
        "samples": results["samples"],
        **registered,
        "tracking": "degraded: " + "; ".join(tracking.DEGRADED) if tracking.DEGRADED else "ok",
    }
    logger.info(f"pretrain-difflm finished: {summary['hf_dir']}")
    return summary
