"""Where evaluate-latest's scores go in MLflow: into the MLflow run of the pretrain-difflm execution that trains the
run directory (at step = the checkpoint's iteration, beside its training curves), else into a run of its own, one
per run directory. MLflow is imported inside the functions, as everywhere in difflm.tracking."""

from __future__ import annotations

from difflm.config import PipelineConfig, safe_load
from difflm.manifest import DataManifest
from difflm.rundir import RunDir, run_name
from difflm.tracking.degraded import tolerant
from difflm.tracking.mlflow_runs import experiment_id, tracking_uri, use_store

SCORED = ("nll_per_token", "ppl", "bits_per_token")  # logged as eval_latest.<key>


def training_mlflow_run(cfg: PipelineConfig, run: RunDir) -> str | None:
    """The MLflow run of the pretrain-difflm execution that trains `run`, if any: the first run tagged with it
    (pretrain-difflm tags `train.run_dir` once training returns) or, while it trains, the newest pretrain-difflm
    run on the same data whose resolved config names this run directory."""
    import mlflow  # imported when tracking is on: runs with tracking.enabled=false never load it
    from mlflow.tracking import MlflowClient

    exp = mlflow.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        return None
    client = MlflowClient()
    # the parent (not its stage runs) of the FIRST execution that trained this run directory: the run its
    # registered version links to; later executions that found the stages cached only point at it
    tagged = client.search_runs(
        [exp.experiment_id],
        f"tags.`train.run_dir` = '{run.path}' and tags.flow = 'pretrain-difflm'",
        max_results=1,
        order_by=["attributes.start_time ASC"],
    )
    if tagged:
        return tagged[0].info.run_id
    data = DataManifest.read(run.manifest_file)
    for candidate in client.search_runs(
        [exp.experiment_id],
        f"tags.flow = 'pretrain-difflm' and tags.`data.hash` = '{data.hash}'",
        max_results=20,
        order_by=["attributes.start_time DESC"],
    ):
        try:
            their = PipelineConfig.model_validate(
                safe_load(mlflow.artifacts.load_text(f"{candidate.info.artifact_uri}/config/resolved.yaml"))
            ).with_unique_tokens(data.unique_tokens)  # logged before a length in epochs had its steps
        except Exception:  # no config artifact (tracking degraded then): not provably this run
            continue
        if run_name(their, data.hash) == run.name:
            return candidate.info.run_id
    return None


def log_latest_score(cfg: PipelineConfig, run: RunDir, iteration: int, score: dict) -> str | None:
    """Log the score at step = `iteration` into the training's MLflow run, else into a run of its own (one per
    run directory, reused by every scheduled call, tagged difflm.run_dir); returns that run's id. Tracking
    problems degrade (reported, not raised), as everywhere in the pipeline; None with tracking off."""
    return _log_latest_score(cfg, run, iteration, score) if cfg.tracking.enabled else None


@tolerant
def _log_latest_score(cfg: PipelineConfig, run: RunDir, iteration: int, score: dict) -> str:
    from mlflow.tracking import MlflowClient  # as above: only with tracking on

    use_store(tracking_uri(cfg))
    client = MlflowClient()
    run_id = training_mlflow_run(cfg, run) or _own_run(cfg, run, client)
    for key in SCORED:
        client.log_metric(run_id, f"eval_latest.{key}", float(score[key]), step=int(iteration))
    return run_id


def _own_run(cfg: PipelineConfig, run: RunDir, client) -> str:
    """evaluate-latest's own MLflow run of `run` (created by the first call, found by the next ones)."""
    exp = experiment_id(cfg)
    mine = client.search_runs(
        [exp], f"tags.flow = 'evaluate-latest' and tags.`difflm.run_dir` = '{run.path}'", max_results=1
    )
    if mine:
        run_id = mine[0].info.run_id
    else:
        tags = {"flow": "evaluate-latest", "difflm.run_dir": str(run.path), "data.hash": run.data_hash()}
        run_id = client.create_run(exp, run_name=f"evaluate-latest-{run.name}", tags=tags).info.run_id
    client.set_terminated(run_id)  # each scheduled call adds points; the run is never left RUNNING
    return run_id
