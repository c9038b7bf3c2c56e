"""MLflow tracking: one run per pipeline execution, a local sqlite store unless a URI is configured.

MLflow (seconds to import) is imported inside the functions that use it: the CLI's `--help` and runs with
tracking off never load it."""

from __future__ import annotations

import json
import os
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import numpy as np

from difflm.config import PipelineConfig, TrackingConfig
from difflm.config.train import epochs_seen
from difflm.credentials import check_tracking_uri, same_server
from difflm.locks import exclusive
from difflm.manifest import DataManifest
from difflm.rundir import TrainResult, Workdir, lock_file
from difflm.tracking import registry
from difflm.tracking.dead_runs import note_flow_run, note_mlflow_run, without_userinfo
from difflm.tracking.degraded import degrade, tolerant

SQLITE = "sqlite:///"


# mlflow.set_tracking_uri also exports the URI as $MLFLOW_TRACKING_URI, where a URI the pipeline chose (a config's
# tracking_uri, a workdir's sqlite store) must not pass for the user's choice: a long-lived `difflm serve`, or a
# process it starts (which inherits the variable), would track a second workdir into the first one's store. So
# use_store names its choice in CHOSEN_VAR too, and only a $MLFLOW_TRACKING_URI other than that one is the user's.
CHOSEN_VAR = "DIFFLM_TRACKING_URI_CHOSEN"


def tracking_uri(cfg: PipelineConfig) -> str:
    """The configured URI, else $MLFLOW_TRACKING_URI (a server, e.g. in docker compose) unless the pipeline set
    it, else the workdir's local sqlite store. A configured server other than $MLFLOW_TRACKING_URI's, while
    MLflow credentials are set, is refused (difflm.credentials.ForeignTrackingServer): they would go there."""
    env = users_uri()
    configured = cfg.tracking.tracking_uri
    if configured:
        check_tracking_uri(configured, env)
        # the user's own spelling of the same server: use_store then keeps it the user's choice, not ours
        return env if env and same_server(configured, env) else configured
    return env or f"{SQLITE}{Workdir.of(cfg).mlflow_store}"


def users_uri() -> str | None:
    """$MLFLOW_TRACKING_URI when the user set it (not the pipeline's own use_store)."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    return env if env and env != os.environ.get(CHOSEN_VAR) else None


def use_store(uri: str) -> None:
    """`mlflow.set_tracking_uri(uri)`, naming a URI that did not come from the user's $MLFLOW_TRACKING_URI as
    the pipeline's choice (CHOSEN_VAR), for this process and those it starts."""
    import mlflow

    if uri != os.environ.get("MLFLOW_TRACKING_URI") or uri == os.environ.get(CHOSEN_VAR):
        os.environ[CHOSEN_VAR] = uri
    mlflow.set_tracking_uri(uri)


# MLflow 3 opens an experiment without this tag in its GenAI view (traces, token usage); ours train models
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def experiment_id(cfg: PipelineConfig) -> str:
    """The id of the config's MLflow experiment in the current tracking store, created when missing (the one
    place that creates it: the pipeline's runs and evaluate-latest's alike)."""
    import mlflow

    with store_created(cfg):
        exp = mlflow.get_experiment_by_name(cfg.tracking.experiment)
        if exp is None:
            artifacts = None
            if tracking_uri(cfg).startswith(SQLITE):  # keep artifacts beside the store, not in ./mlruns
                artifacts = Workdir.of(cfg).mlartifacts.as_uri()
            exp = mlflow.get_experiment(mlflow.create_experiment(cfg.tracking.experiment, artifact_location=artifacts))
        if exp.tags.get(EXPERIMENT_KIND[0]) is None:  # a user's own choice in the UI is kept
            mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
    return exp.experiment_id


def store_created(cfg: PipelineConfig) -> AbstractContextManager:
    """Within: this process alone creates (and migrates) a local sqlite store, and the experiment in it; two
    processes doing it at once raced in MLflow's migrations ('duplicate column name'). A server's store: nothing."""
    uri = tracking_uri(cfg)
    if not uri.startswith(SQLITE):
        return nullcontext()
    db = Path(uri.removeprefix(SQLITE))
    return exclusive(lock_file(db), f"the MLflow store {db}", "wait", lambda line: print(line, flush=True))


def lineage_tags() -> dict[str, str]:
    """Where this execution comes from: the Prefect flow run (id and UI link) and the code's git commit."""
    tags = {}
    try:
        from prefect.runtime import flow_run  # prefect (seconds to import) stays out of difflm's own import

        if flow_run.id:
            tags["prefect.flow_run_id"] = str(flow_run.id)
            url = str(flow_run.ui_url or "")
            if url.startswith(("http://", "https://")):  # a temporary server has no UI URL ('None/flow-runs/...')
                tags["prefect.flow_run_url"] = url
    except Exception:  # not inside a flow, or no Prefect: nothing to link
        pass
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = dirty = ""
    if commit:
        tags["mlflow.source.git.commit"] = commit
        tags["git.dirty"] = "true" if dirty else "false"
    return tags


@contextmanager
def pipeline_run(
    cfg: PipelineConfig, run_name: str, tags: dict[str, str], parent: str | None = None
) -> Iterator[str | None]:
    """Start the MLflow run of one pipeline execution (or nothing when tracking is off); yields its id.
    `parent`: the run it nests under (a study's), from this thread or another."""
    note_flow_run()
    run = _start_pipeline_run(cfg, run_name, tags, parent) if cfg.tracking.enabled else None
    if run is None:
        yield None
        return
    with _ending(run, "the MLflow run") as run_id:
        yield run_id


def _start_pipeline_run(cfg: PipelineConfig, run_name: str, tags: dict[str, str], parent: str | None = None):
    import mlflow

    Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
    for key, val in {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}.items():
        os.environ.setdefault(key, val)  # an unreachable server costs seconds, not MLflow's default minutes
    uri = tracking_uri(cfg)  # a server the credentials are not for: refused (a UserError), not degraded
    try:
        use_store(uri)
        run = mlflow.start_run(
            experiment_id=experiment_id(cfg),
            run_name=run_name,
            tags={**lineage_tags(), **tags},
            nested=parent is not None,  # MLflow's active runs are per thread: a parent here must be this one
            parent_run_id=parent,
        )
        mlflow.log_params(cfg.flat())
        mlflow.log_dict(cfg.model_dump(mode="json"), "config/resolved.yaml")
        return run
    except Exception as err:  # the pipeline runs without tracking rather than not at all
        degrade(f"could not start an MLflow run at {uri}", err)
        return None


@contextmanager
def study_run(cfg: PipelineConfig, name: str, spec: dict) -> Iterator[str | None]:
    """The parent MLflow run of a study (`cfg`: its first point's, for the store and experiment): the spec as
    an artifact, no config params (each point's run has its own). Nothing when tracking is off."""
    import mlflow

    run = None
    note_flow_run()
    if cfg.tracking.enabled:
        uri = tracking_uri(cfg)  # refused, not degraded, as in _start_pipeline_run
        try:
            use_store(uri)
            tags = {**lineage_tags(), "flow": "study", "study": name}
            run = mlflow.start_run(experiment_id=experiment_id(cfg), run_name=f"study-{name}", tags=tags)
            mlflow.log_dict(spec, "study/spec.yaml")
        except Exception as err:
            degrade(f"could not start the MLflow run of study {name} at {uri}", err)
            run = None
    if run is None:
        yield None
        return
    with _ending(run, f"the MLflow run of study {name}") as run_id:
        yield run_id


@contextmanager
def stage_run(name: str, system_metrics: bool = False) -> Iterator[str | None]:
    """A nested MLflow run for one stage, under the pipeline's run (nothing when there is no active run, i.e.
    tracking is off or could not start). `system_metrics`: MLflow samples CPU, memory (and GPU) meanwhile."""
    run = _start_stage_run(name, system_metrics)
    if run is None:
        yield None
        return
    with _ending(run, f"the MLflow run of stage {name}") as run_id:
        yield run_id


def _start_stage_run(name: str, system_metrics: bool):
    try:
        import mlflow

        parent = mlflow.active_run()
        if parent is None:
            return None
        return mlflow.start_run(
            run_name=f"{parent.info.run_name}/{name}",
            nested=True,
            experiment_id=parent.info.experiment_id,  # else the default experiment
            tags={"stage": name, **lineage_tags()},
            log_system_metrics=system_metrics,
        )
    except Exception as err:
        degrade(f"could not start the MLflow run of stage {name}", err)
        return None


@contextmanager
def _ending(run, what: str) -> Iterator[str]:
    """Yield the run's id; end it FINISHED, or FAILED when the body raised (the body's error propagates as is:
    no yield of these context managers sits inside a handler that could catch it)."""
    import mlflow

    status = "FAILED"
    # should this process die before the end, the next command marks the run failed (difflm.live_runs)
    note_mlflow_run(run.info.run_id, without_userinfo(mlflow.get_tracking_uri()))
    try:
        yield run.info.run_id
        status = "FINISHED"
    finally:
        try:
            mlflow.end_run(status)
        except Exception as err:
            degrade(f"could not close {what}", err)


# MLflow 3.17 keeps a run page's chart layout in the browser only, and its default puts the one-value charts
# (eval.*, sorted first by name) before the curves, one metric per chart. The one layout a server can hold is
# an experiment's shared view (tag `mlflow.sharedViewState.<key>`, opened with `?viewStateShareKey=<key>`):
# one per run, keyed by the run id, showing that run with loss and val_loss overlaid on the first chart.
SHARED_VIEW_TAG = "mlflow.sharedViewState."
CURVES = ("loss", "val_loss")


def training_view(run_id: str) -> dict:
    """The shared view state of `run_id`: that run only, section "Training curves" first with loss and val_loss
    on one chart (val_loss's own chart marked deleted, so the UI does not add it again); the UI appends the
    other metrics below in its "Model metrics" section."""
    overlay = {
        "uuid": "difflm-curves",
        "type": "LINE",
        "metricSectionId": "difflm-training-curves",
        "displayName": " and ".join(CURVES),
        "metricKey": CURVES[0],
        "selectedMetricKeys": list(CURVES),
        "runsCountToCompare": 10,
        "deleted": False,
        "isGenerated": False,
        "xAxisKey": "step",
        "xAxisScaleType": "linear",
        "scaleType": "linear",
        "yAxisKey": "metric",
        "yAxisExpressions": [],
        "range": {},
        "lineSmoothness": 0,
        "selectedXAxisMetricKey": "",
        "ignoreOutliers": False,
        "useGlobalXaxisKey": True,
        "useGlobalLineSmoothing": True,
    }
    covered = {
        **overlay,
        "uuid": "difflm-val-loss",
        "metricKey": CURVES[1],
        "selectedMetricKeys": None,
        "deleted": True,
    }
    section = {"uuid": "difflm-training-curves", "name": "Training curves", "display": True}
    return {
        "searchFilter": f"attributes.run_id = '{run_id}'",
        "compareRunCharts": [overlay, covered],
        "compareRunSections": [{**section, "isReordered": False, "deleted": False, "isGenerated": False}],
        "isAccordionReordered": True,  # keep our section first
    }


@tolerant
def share_training_view(run_id: str) -> str:
    """Store the run's training view on its experiment (see `training_view`); returns its share key."""
    import mlflow

    run = mlflow.get_run(run_id)
    mlflow.MlflowClient().set_experiment_tag(
        run.info.experiment_id, SHARED_VIEW_TAG + run_id, json.dumps(training_view(run_id))
    )
    return run_id


def child_env(cfg: PipelineConfig, run_id: str | None) -> dict[str, str]:
    """Environment for the training subprocess so it logs live metrics to the same run."""
    if not run_id:
        return {}
    # the trainer sends metrics from a background thread: short HTTP timeouts and few retries per attempt let
    # it notice an outage quickly (it retries on its own, with backoff, and training never waits for it)
    return {
        "MLFLOW_TRACKING_URI": tracking_uri(cfg),
        "DIFFLM_MLFLOW_RUN_ID": run_id,
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    }


def experiment_of(run_id: str | None) -> str | None:
    """The experiment id of the active run `run_id` (None without one)."""
    try:
        import mlflow

        run = mlflow.active_run()
        return run.info.experiment_id if run and run.info.run_id == run_id else None
    except Exception:
        return None


@tolerant
def set_tags(tags: dict[str, str]) -> None:
    import mlflow

    mlflow.set_tags(tags)


@tolerant
def log_files(paths: list[Path], folder: str) -> None:
    """Files as artifacts of the active run, under `folder`."""
    import mlflow

    for path in paths:
        mlflow.log_artifact(str(path), folder)


@tolerant
def log_text(text: str, artifact_file: str) -> None:
    import mlflow

    mlflow.log_text(text, artifact_file)


def log_stage(run_id: str | None, cached: bool, **tags) -> None:
    """Tags of a stage's nested run: whether Prefect's cache skipped it, and where its output is."""
    if run_id:
        set_tags({"cached": str(cached).lower(), **{k: str(v) for k, v in tags.items()}})


@tolerant
def log_data_stats(manifest: DataManifest, context: str = "training") -> None:
    """The prepared data as an MLflow dataset input of the active run (source = the data folder, digest = the
    data hash, schema = token ids, counts per split as input tags), the manifest as an artifact, `data.hash`
    as a tag. Counts are tags of the input, not single-point metrics that would crowd the run's charts."""
    import mlflow

    mlflow.log_input(dataset(manifest), context=context, tags=data_counts(manifest))
    mlflow.log_dict(manifest.to_dict(), "data/manifest.json")
    mlflow.set_tags({"data.hash": manifest.hash, "data.dir": manifest.dir})


def length_params(cfg: PipelineConfig, unique_tokens: int) -> dict[str, int | float]:
    """The run's length: its steps, the unique training tokens (the data.unique_tokens subset's, or the whole
    split's) and the epochs over them that the steps make (`cfg` with its length in steps)."""
    t = cfg.train
    epochs = epochs_seen(t.train_iters, unique_tokens, t.global_batch_size, t.seq_length)
    return {
        "train.train_iters": t.train_iters,
        "train.unique_tokens": unique_tokens,
        "train.planned_epochs": round(epochs, 4),
    }


@tolerant
def log_length(cfg: PipelineConfig, unique_tokens: int) -> None:
    """`length_params` as params of the active run."""
    import mlflow

    mlflow.log_params(length_params(cfg, unique_tokens))


def dataset(manifest: DataManifest):
    """An `mlflow.data` dataset for a data-prep manifest (no data is uploaded: the source is its folder)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types import Schema, TensorSpec

    names = [src.get("name", "data") for src in manifest.sources] or ["data"]
    dtype = np.dtype("uint32") if manifest.token_bytes > 2 else np.dtype("uint16")
    with warnings.catch_warnings():  # MLflow registers the local source twice and warns the URI is ambiguous
        warnings.simplefilter("ignore", UserWarning)
        source = resolve_dataset_source(Path(manifest.dir).resolve().as_uri())
    return MetaDataset(
        source, name="+".join(names), digest=manifest.hash, schema=Schema([TensorSpec(dtype, (-1,), "token_ids")])
    )


def data_counts(manifest: DataManifest) -> dict[str, str]:
    """Documents and tokens per split (and per source), tokenizer size, what data prep skipped."""
    counts = {"vocab_size": str(manifest.tokenizer.vocab_size)}
    for split, s in manifest.splits.items():
        counts.update({f"{split}.documents": str(s.documents), f"{split}.tokens": str(s.tokens)})
        for src, c in s.sources.items():
            counts.update({f"{split}.{src}.documents": str(c["documents"]), f"{split}.{src}.tokens": str(c["tokens"])})
    counts.update({f"skipped.{k}": str(n) for k, n in manifest.skipped.items()})
    if manifest.instruction is not None:  # instruction data: which chat template made its tokens and masks
        counts.update({"kind": manifest.kind, "chat_template": str(manifest.instruction.get("template"))})
    return counts


def reconcile_metrics(run_id: str, records: list[dict]) -> int:
    """Log every metrics.jsonl value the MLflow run lacks (a reused training run, or metrics the trainer could
    not send while the server was down); returns how many were sent. Idempotent: run it again, nothing new.
    One value per (key, step), the copy logged last: a file written before the trainer dropped a resumed
    attempt's re-logged steps holds some twice."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    keys = {k for rec in records for k in rec if k not in ("step", "time")}
    have = {k: {m.step for m in client.get_metric_history(run_id, k)} for k in keys}
    last = {
        (k, int(rec["step"])): Metric(k, float(v), int(rec.get("time", 0) * 1000), int(rec["step"]))
        for rec in records
        for k, v in rec.items()
        if k not in ("step", "time") and v is not None
    }
    missing = [m for (k, step), m in last.items() if step not in have[k]]
    for i in range(0, len(missing), 500):
        client.log_batch(run_id, metrics=missing[i : i + 500])
    return len(missing)


@tolerant
def log_training(trained: TrainResult, records: list[dict], live: bool = True) -> None:
    """The run directory's curves (metrics.jsonl values the run lacks), its files and tags, into the active run.
    `live`: the trainer was sending to this run, so anything sent now was missed (said so); otherwise (the
    parent of a nested training run, a reused run) the curves are copied as a matter of course."""
    import mlflow

    sent = reconcile_metrics(mlflow.active_run().info.run_id, records)
    if sent and live and not trained.reused:
        print(f"tracking: backfilled {sent} training metrics the trainer could not send live", flush=True)
    mlflow.set_tag("train.run_dir", str(trained.run.path))
    mlflow.set_tag("train.checkpoint", str(trained.checkpoint))
    for name in ("metrics.jsonl", "train.log", "config.yaml", "curves.png"):
        path = trained.run.path / name
        if path.exists():
            mlflow.log_artifact(str(path), "train")


@tolerant
def log_and_register_model(
    cfg: PipelineConfig,
    hf_dir: Path,
    run_id: str,
    checkpoint: str,
    manifest: DataManifest | None = None,
    results: dict | None = None,
    lineage: dict | None = None,
) -> dict:
    """Upload the HF folder as an artifact and register it (see difflm.tracking.registry): one model version per
    trained checkpoint (a rerun that reuses the checkpoint points at the existing version instead of adding a
    copy), alias `candidate`, `champion` when its `tracking.champion_metric` beats the champion's, and a
    readable description. Returns the artifact URI, the name, version and the promotion decision."""
    import mlflow
    from mlflow.tracking import MlflowClient

    name = registry.registered_model_name(cfg)
    if name:  # refused before anything is uploaded when the name is not the pipeline's alone
        registry.claim_model(MlflowClient(), name, tracking_uri(cfg), cfg.tracking)
    known = registry.version_of_checkpoint(MlflowClient(), name, checkpoint) if name else None
    if known is not None and registry.TAG_PROMOTION in known.tags:
        # a rerun of the same checkpoint (stages cached): point at the version, do not upload the weights again
        out = {"artifact_uri": known.source}
    else:
        mlflow.log_artifacts(str(hf_dir), "hf_model")
        out = {"artifact_uri": mlflow.get_artifact_uri("hf_model")}
    if name:
        out.update(
            registry.register_version(
                cfg,
                name,
                source=out["artifact_uri"],
                run_id=run_id,
                checkpoint=checkpoint,
                uri=tracking_uri(cfg),
                hf_dir=hf_dir,
                manifest=manifest,
                results=results,
                lineage=lineage,
            )
        )
        mlflow.set_tag("registered_model_version", f"{name}/{out['version']}")
    return out


def download_model_version(uri: str, store: str, tracking: TrackingConfig | None = None) -> Path:
    """The folder of a registered version, `models:/<name>/<version>` or `models:/<name>@<alias>`, downloaded
    from the MLflow store (a local artifact store is read in place). LookupError when it does not exist;
    registry.UntrustedModel, before anything is downloaded, when the server records that someone outside the
    pipeline user and `tracking.trusted_registrants` may write to the model, or that the pipeline user does not
    manage it (registry.UntrustedVersion on a store without accounts: when its registrant tag names neither);
    registry.ExportMismatch when its files are not the ones
    registered (their SHA-256 in the version's tags)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    use_store(store)
    client = MlflowClient()
    ref = uri[len("models:/") :]
    try:
        if "@" in ref:
            name, alias = ref.split("@", 1)
            mv = client.get_model_version_by_alias(name, alias)
        else:
            name, version = ref.rsplit("/", 1)
            mv = client.get_model_version(name, version)
    except Exception as err:  # MlflowException RESOURCE_DOES_NOT_EXIST, or a malformed reference
        raise LookupError(f"{uri}: no such registered model version in {store} ({err})") from err
    what = f"{uri} (version {mv.version}, {mv.source})"
    registry.recorded_digests(mv.tags, what)  # tags only: checked before anything is downloaded
    trust = tracking or TrackingConfig()
    if not registry.check_model(store, name, trust, what):  # no accounts: only the registrant's tag to go by
        registry.check_owner(mv.tags, trust, what)
    folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=mv.source))
    registry.verify_export(folder, mv.tags, f"{uri} (version {mv.version}, {mv.source})")
    return folder
