"""MLflow tracking: one run per pipeline execution, a local sqlite store unless a URI is configured."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from difflm import registry
from difflm.config import PipelineConfig


def tracking_uri(cfg: PipelineConfig) -> str:
    """The configured URI, else $MLFLOW_TRACKING_URI (a server, e.g. in docker compose), else local sqlite."""
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(Path(cfg.workdir) / 'mlflow.db').resolve()}"


def _experiment_id(cfg: PipelineConfig) -> str:
    import mlflow

    exp = mlflow.get_experiment_by_name(cfg.tracking.experiment)
    if exp is not None:
        return exp.experiment_id
    artifacts = None
    if tracking_uri(cfg).startswith("sqlite:///"):  # keep artifacts beside the store, not in ./mlruns
        artifacts = (Path(cfg.workdir) / "mlartifacts").resolve().as_uri()
    return mlflow.create_experiment(cfg.tracking.experiment, artifact_location=artifacts)


@contextmanager
def pipeline_run(cfg: PipelineConfig, run_name: str, tags: dict[str, str]) -> Iterator[str | None]:
    """Start the MLflow run of one pipeline execution (or nothing when tracking is off); yields its id."""
    if not cfg.tracking.enabled:
        yield None
        return
    import mlflow

    Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
    for key, val in {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}.items():
        os.environ.setdefault(key, val)  # an unreachable server costs seconds, not MLflow's default minutes
    try:
        mlflow.set_tracking_uri(tracking_uri(cfg))
        run = mlflow.start_run(experiment_id=_experiment_id(cfg), run_name=run_name, tags=tags)
        mlflow.log_params(cfg.flat())
        mlflow.log_dict(cfg.model_dump(mode="json"), "config/resolved.yaml")
    except Exception as err:  # the pipeline runs without tracking rather than not at all
        degrade(f"could not start an MLflow run at {tracking_uri(cfg)}", err)
        yield None
        return
    status = "FAILED"
    try:
        yield run.info.run_id
        status = "FINISHED"
    finally:
        try:
            mlflow.end_run(status)
        except Exception as err:
            degrade("could not close the MLflow run", err)


DEGRADED: list[str] = []  # what tracking could not do in this process (the flow reports it)


def degrade(what: str, err: BaseException) -> None:
    """Tracking failed: say so once per kind of failure, remember it, go on."""
    note = f"{what} ({type(err).__name__}: {str(err)[:200]})"
    if not any(d.startswith(what) for d in DEGRADED):
        print(f"tracking degraded: {note}; the pipeline goes on (metrics stay in the run directory)", flush=True)
    DEGRADED.append(note)


def tolerant(fn):
    """A tracking call that never fails the pipeline: errors are reported by `degrade` and return None."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            degrade(f"{fn.__name__} failed", err)
            return None

    return wrapper


def child_env(cfg: PipelineConfig, run_id: str | None) -> dict[str, str]:
    """Environment for the training subprocess so it logs live metrics to the same run."""
    if not run_id:
        return {}
    # the trainer sends metrics from a background thread: short HTTP timeouts and few retries per attempt let
    # it notice an outage quickly (it retries on its own, with backoff, and training never waits for it)
    return {"MLFLOW_TRACKING_URI": tracking_uri(cfg), "DIFFLM_MLFLOW_RUN_ID": run_id,
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


@tolerant
def log_data_stats(manifest: dict) -> None:
    import mlflow

    for split, s in manifest["splits"].items():
        mlflow.log_metrics({f"data.{split}.documents": s["documents"], f"data.{split}.tokens": s["tokens"]})
        for src, c in s.get("sources", {}).items():
            mlflow.log_metrics({f"data.{split}.{src}.documents": c["documents"], f"data.{split}.{src}.tokens": c["tokens"]})
    for key, n in manifest.get("skipped", {}).items():
        mlflow.log_metric(f"data.{key}", n)
    mlflow.log_metric("data.vocab_size", manifest["tokenizer"]["vocab_size"])
    mlflow.log_dict(manifest, "data/manifest.json")
    mlflow.set_tag("data.hash", manifest["hash"])


def reconcile_metrics(run_id: str, records: list[dict]) -> int:
    """Log every metrics.jsonl value the MLflow run lacks (a reused training run, or metrics the trainer could
    not send while the server was down); returns how many were sent. Idempotent: run it again, nothing new."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    keys = {k for rec in records for k in rec if k not in ("step", "time")}
    have = {k: {m.step for m in client.get_metric_history(run_id, k)} for k in keys}
    missing = [Metric(k, float(v), int(rec.get("time", 0) * 1000), int(rec["step"]))
               for rec in records for k, v in rec.items()
               if k not in ("step", "time") and v is not None and int(rec["step"]) not in have[k]]
    for i in range(0, len(missing), 500):
        client.log_batch(run_id, metrics=missing[i : i + 500])
    return len(missing)


@tolerant
def log_training(train_info: dict, records: list[dict]) -> None:
    import mlflow

    sent = reconcile_metrics(mlflow.active_run().info.run_id, records)
    if sent and not train_info["reused"]:
        print(f"tracking: backfilled {sent} training metrics the trainer could not send live", flush=True)
    mlflow.set_tag("train.run_dir", train_info["run_dir"])
    mlflow.set_tag("train.checkpoint", train_info["checkpoint"])
    for name in ("metrics.jsonl", "train.log", "config.yaml", "curves.png"):
        path = Path(train_info["run_dir"]) / name
        if path.exists():
            mlflow.log_artifact(str(path), "train")


@tolerant
def log_evaluation(results: dict, prefix: str = "eval") -> None:
    """Bounds and task scores as metrics, samples as a table (with their sampler settings), the report; the
    device and dtype that produced them as tags `<prefix>.device`, `.dtype`, `.device_name` (the params hold
    what was asked for, eval.device=auto; the tags what it resolved to)."""
    import mlflow

    mlflow.set_tags({f"{prefix}.{k}": results[k] for k in ("device", "dtype", "device_name") if k in results})
    for name, res in results["bounds"].items():
        mlflow.log_metrics({f"{prefix}.{name}.nll_per_token": res["nll_per_token"], f"{prefix}.{name}.ppl": res["ppl"]})
    for task, scores in results.get("tasks", {}).items():
        mlflow.log_metrics({f"{prefix}.{task}.{k}": float(v) for k, v in scores.items()
                            if isinstance(v, (int, float)) and k not in ("items", "chance")})
    mlflow.log_dict(results, f"{prefix}/results.json")
    samples = results.get("samples", [])
    if samples:
        mlflow.log_table({"prompt": [s["prompt"] for s in samples], "completion": [s["completion"] for s in samples],
                          "tokens": [s["tokens"] for s in samples], "model_calls": [s["model_calls"] for s in samples],
                          "sampler": [json.dumps(s["sampler"]) for s in samples]}, f"{prefix}/samples.json")
    text = "\n\n".join(f"PROMPT: {s['prompt']}\nCOMPLETION: {s['completion']}" for s in samples)
    mlflow.log_text(text or "(no samples)", f"{prefix}/samples.txt")
    if results.get("report") and Path(results["report"]).exists():
        mlflow.log_artifact(results["report"], prefix)


@tolerant
def log_sweep(rows: list[dict], plot: Path) -> None:
    """Sampler sweep: accuracy and tokens/s with the steps as the x axis, and the plot."""
    import mlflow

    for r in rows:
        mlflow.log_metrics({"sweep.cloze_gen_accuracy": r["accuracy"], "sweep.tokens_per_s": r["tokens_per_s"]},
                           step=int(r["steps"]))
    if rows and plot.exists():
        mlflow.log_artifact(str(plot), "eval")


@tolerant
def log_and_register_model(cfg: PipelineConfig, hf_dir: Path, run_id: str, checkpoint: str,
                           manifest: dict | None = None, results: dict | None = None) -> dict:
    """Upload the HF folder as an artifact and register it (see difflm.registry): one model version per
    trained checkpoint (a rerun that reuses the checkpoint points at the existing version instead of adding a
    copy), alias `candidate`, `champion` when its `tracking.champion_metric` beats the champion's, and a
    readable description. Returns the artifact URI, the name, version and the promotion decision."""
    import mlflow

    mlflow.log_artifacts(str(hf_dir), "hf_model")
    out = {"artifact_uri": mlflow.get_artifact_uri("hf_model")}
    name = registry.registered_model_name(cfg)
    if name:
        out.update(registry.register_version(cfg, name, source=out["artifact_uri"], run_id=run_id,
                                             checkpoint=checkpoint, uri=tracking_uri(cfg), hf_dir=hf_dir,
                                             manifest=manifest, results=results))
        mlflow.set_tag("registered_model_version", f"{name}/{out['version']}")
    return out


def download_model_version(uri: str, store: str) -> Path:
    """The folder of a registered version, `models:/<name>/<version>` or `models:/<name>@<alias>`, downloaded
    from the MLflow store (a local artifact store is read in place). LookupError when it does not exist."""
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(store)
    client = MlflowClient()
    ref = uri[len("models:/"):]
    try:
        if "@" in ref:
            name, alias = ref.split("@", 1)
            mv = client.get_model_version_by_alias(name, alias)
        else:
            name, version = ref.rsplit("/", 1)
            mv = client.get_model_version(name, version)
    except Exception as err:  # MlflowException RESOURCE_DOES_NOT_EXIST, or a malformed reference
        raise LookupError(f"{uri}: no such registered model version in {store} ({err})") from err
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=mv.source))


def disable_telemetry() -> None:
    for key, val in {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}.items():
        os.environ.setdefault(key, val)
