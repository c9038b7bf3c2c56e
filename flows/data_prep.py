"""The `data-prep` flow: raw text -> verified Megatron datasets, statistics in MLflow."""

from prefect import flow

from difflm import tracking
from difflm.config import PipelineConfig, load_config
from difflm.manifest import DataManifest
from difflm.tasks import artifacts
from difflm.tasks.stages import data_prep_task


@flow(name="data-prep", log_prints=True)
def data_prep(
    preset: str = "tiny-cpu", overrides: list[str] | None = None, config: PipelineConfig | None = None
) -> DataManifest:
    """Tokenize and pack the configured sources into Megatron .bin/.idx with a manifest.

    Args:
        preset: a preset in configs/ or a YAML path (ignored when `config` is given).
        overrides: `section.field=value` overrides applied on top of the preset.
        config: a complete configuration.
    """
    cfg = config or load_config(preset, overrides or [])
    with tracking.pipeline_run(
        cfg, f"{cfg.name}-data-prep-{cfg.data_label()}", {"flow": "data-prep", "preset": cfg.name}
    ) as run_id:
        manifest = data_prep_task(cfg)
        if run_id:
            tracking.log_data_stats(manifest, context="output")
        link = artifacts.mlflow_run_url(tracking.tracking_uri(cfg), tracking.experiment_of(run_id), run_id)
    artifacts.publish("data-prep-summary", artifacts.data_markdown(manifest), "data prep", link)
    return manifest
