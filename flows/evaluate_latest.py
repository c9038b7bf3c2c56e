"""The `evaluate-latest` flow: score the newest complete checkpoint of a training run, while it trains, and log
the score to MLflow at that step. Meant to run on a schedule (prefect.yaml); a checkpoint already scored is
skipped. From the command line: `difflm eval-latest RUN_DIR` (once) or `difflm serve evaluate-latest --run-dir RUN_DIR`
(on a schedule, in this process)."""

from __future__ import annotations

import time

from prefect import flow, get_run_logger

from difflm.config import PipelineConfig
from difflm.locks import exclusive
from difflm.rundir import RunDir, lock_file
from difflm.tasks.latest import evaluated_scores, remember_score
from difflm.tasks.sources import stage_config, training_run_dir
from difflm.tasks.stages import export_newest_task, score_bound_task
from difflm.tracking import log_latest_score


@flow(name="evaluate-latest", log_prints=True)
def evaluate_latest(
    run_dir: str,
    preset: str | None = None,
    overrides: list[str] | None = None,
    config: PipelineConfig | None = None,
    max_sequences: int = 16,
    force: bool = False,
) -> dict:
    """Evaluate the newest complete checkpoint of a training run: {iteration, score, ...}.

    Args:
        run_dir: the training run directory (<workdir>/runs/<run>); it may still be training.
        preset: a preset in configs/ or a YAML path; empty: the run's own config.yaml (recommended).
        overrides: `section.field=value` overrides (eval.device, eval.t_samples, tracking.*).
        config: a complete configuration (replaces preset and overrides).
        max_sequences: at most this many held-out windows (and at most eval.max_sequences): a cheap score.
        force: score the newest checkpoint again even when it was scored before.
    """
    logger = get_run_logger()
    run = training_run_dir(run_dir)  # the one place the parameter becomes a RunDir
    if config is None:
        cfg = stage_config(run, preset, overrides)
    else:
        cfg = config if isinstance(config, PipelineConfig) else PipelineConfig.model_validate(config)
    # one scorer of the run at a time (a slow call and the next scheduled one would export into the same
    # folder); the trainer never takes this lock, so scoring never holds training up
    with exclusive(lock_file(run.eval_latest), "evaluate-latest output", cfg.pipeline.on_busy, logger.info):
        return _score_newest(cfg, run, max_sequences, force, logger)


def _score_newest(cfg: PipelineConfig, run: RunDir, max_sequences: int, force: bool, logger) -> dict:
    newest, done = run.latest_iteration(), evaluated_scores(run)
    if newest is None:
        logger.info(f"{run.name}: no complete checkpoint yet; nothing to evaluate")
        return {"iteration": None, "score": None, "skipped": "no complete checkpoint yet"}
    if newest in done and not force:
        logger.info(f"{run.name}: iteration {newest} was evaluated already (score {done[newest]['score']:.4f})")
        return {**done[newest], "skipped": "already evaluated"}
    manifest = run.manifest()
    iteration, hf_dir = export_newest_task(cfg, manifest, run)
    # the evaluation record of this checkpoint's score, beside scores.json
    score = score_bound_task(cfg, manifest, hf_dir, max_sequences, str(run.eval_latest / f"iter_{iteration:07d}"))
    run_id = log_latest_score(cfg, run, iteration, score)
    record = {
        "iteration": iteration,
        "score": score["nll_per_token"],
        **score,
        "mlflow_run_id": run_id,
        "time": time.time(),
    }
    remember_score(run, record)
    logger.info(
        f"{run.name}: iteration {iteration} scored {record['score']:.4f} nats/token"
        + (f" (MLflow run {run_id}, step {iteration})" if run_id else "")
    )
    return record
