"""Prefect tasks: thin wrappers over the plain stage functions (each testable without Prefect).

Caching is off on purpose: every stage already reuses its content-addressed output directory,
which also survives Prefect's state being wiped.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from difflm.config import PipelineConfig
from data_prep.pipeline import prepare_data
from models.launch.torchrun import TrainingError, TrainingPreempted, launch_training
from models.evaluation.likelihood import KIND_LABELS
from models.evaluation.stages import convert_checkpoint, evaluate_export, sweep_export


@task(name="data-prep", cache_policy=NO_CACHE)
def data_prep_task(cfg: PipelineConfig) -> dict:
    manifest = prepare_data(cfg)
    s = manifest["splits"]
    get_run_logger().info(
        f"data: {s['train']['documents']} train docs / {s['train']['tokens']:,} tokens, "
        f"{s['valid']['documents']} valid docs / {s['valid']['tokens']:,} tokens -> {manifest['dir']}"
    )
    return manifest


def _resumable(task, task_run, state) -> bool:
    """Retry training when a rerun resumes usefully: a preemption or a crashed/killed trainer; not a stop
    on non-finite values (the same data would fail the same way) or an invalid setup."""
    err = state.result(raise_on_failure=False)
    if isinstance(err, TrainingPreempted):
        return True
    return isinstance(err, TrainingError) and "non-finite" not in str(err) and "nnodes" not in str(err)


@task(name="train", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 30], retry_condition_fn=_resumable)
def train_task(cfg: PipelineConfig, manifest: dict, env: dict[str, str]) -> dict:
    logger = get_run_logger()
    return launch_training(cfg, manifest, env=env, echo=logger.info)


@task(name="convert-to-hf", cache_policy=NO_CACHE)
def convert_task(cfg: PipelineConfig, manifest: dict, train_info: dict) -> str:
    out = convert_checkpoint(cfg, manifest, train_info)
    get_run_logger().info(f"Hugging Face export: {out}")
    return str(out)


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(cfg: PipelineConfig, manifest: dict, hf_dir: str, out_dir: str | None = None,
                  untrained: bool = True) -> dict:
    results = evaluate_export(cfg, manifest, Path(hf_dir), Path(out_dir) if out_dir else None, untrained)
    b = results["bounds"]
    kind = KIND_LABELS[b["trained"]["kind"]]
    get_run_logger().info(
        f"validation {kind}: trained {b['trained']['ppl']:.1f}"
        + (f" vs untrained {b['untrained']['ppl']:.1f}" if "untrained" in b else "")
        + f" (on {results['device']}, {results['dtype']})"
    )
    for name, scores in results["tasks"].items():
        get_run_logger().info(f"task {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()
                                                           if isinstance(v, float)))
    return results


@task(name="sampler-sweep", cache_policy=NO_CACHE)
def sweep_task(cfg: PipelineConfig, manifest: dict, hf_dir: str, out_dir: str) -> list[dict]:
    return sweep_export(cfg, manifest, Path(hf_dir), Path(out_dir))
