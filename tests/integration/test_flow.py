"""The flagship flow end to end on the test-tiny preset, on a real Prefect server and MLflow store."""

import json
import os
from pathlib import Path

import mlflow
import pytest
from helpers import tiny_config
from mlflow.tracking import MlflowClient
from prefect.artifacts import Artifact
from scenarios import SCENARIOS

from difflm.flows.data_prep import data_prep
from difflm.flows.evaluate import evaluate
from difflm.flows.pretrain import pretrain_difflm
from difflm.manifest import DataManifest
from difflm.models.hf.convert import load_hf
from difflm.tracking import tracking_uri, training_view

FLOW = SCENARIOS["flagship"].overrides
STAGES = SCENARIOS["flagship"].stages


@pytest.fixture(scope="module")
def first(session_dir, prefect_harness) -> dict:
    """One run of the flagship flow from nothing (the tests below each check one property of it): its summary,
    config, MLflow client, run and the nested runs of its stages."""
    sampling = {"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1", "MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING": "1"}
    saved = {k: os.environ.get(k) for k in sampling}
    os.environ.update(sampling)  # system metrics sampled within a short training
    try:
        cfg = tiny_config(session_dir / "flow", *FLOW)
        summary = pretrain_difflm(config=cfg)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    mlflow.set_tracking_uri(tracking_uri(cfg))
    client = MlflowClient()
    run = client.get_run(summary["mlflow_run_id"])
    children = {
        r.data.tags["stage"]: r
        for r in client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    }
    manifest = DataManifest.read(Path(summary["data_dir"]) / "manifest.json")
    return {"summary": summary, "cfg": cfg, "client": client, "run": run, "children": children, "manifest": manifest}


@pytest.mark.slow
def test_every_stage_ran_the_first_time(first):
    assert first["summary"]["stages"] == dict.fromkeys(STAGES, "ran")


@pytest.mark.slow
def test_data_checkpoint_and_an_export_transformers_loads(first):
    summary = first["summary"]
    assert (Path(summary["data_dir"]) / "manifest.json").exists()
    assert (Path(summary["run_dir"]) / "checkpoints" / "iter_0000030" / "metadata.json").exists()
    model = load_hf(Path(summary["hf_dir"]))
    assert model.config.mask_token_id == first["manifest"].tokenizer.mask_id


@pytest.mark.slow
def test_training_helped_and_samples_record_their_sampler(first):
    v, cfg = first["summary"]["validation"], first["cfg"]
    assert v["trained"]["bound"] and v["trained"]["nll_per_token"] < v["untrained"]["nll_per_token"]
    samples = first["summary"]["samples"]
    assert samples and samples[0]["sampler"]["steps"] == cfg.eval.sampler.steps


@pytest.mark.slow
def test_one_mlflow_run_with_params_and_curves(first):
    client, run = first["client"], first["run"]
    assert run.data.params["train.train_iters"] == "30"
    unique = first["manifest"].splits["train"].tokens  # every run records its unique tokens and epochs
    assert run.data.params["train.unique_tokens"] == str(unique) == str(first["summary"]["unique_tokens"])
    assert first["summary"]["planned_epochs"] == float(run.data.params["train.planned_epochs"]) > 0
    assert run.data.params["diffusion.model_running_mode"] == "difflm-noshift"
    assert len(client.get_metric_history(run.info.run_id, "loss")) >= 3
    assert len(client.get_metric_history(run.info.run_id, "val_loss")) >= 2


@pytest.mark.slow
def test_the_data_is_a_dataset_input_not_metrics(first):
    run, manifest = first["run"], first["manifest"]
    (data_input,) = [
        d
        for d in run.inputs.dataset_inputs
        if {t.key: t.value for t in d.tags}.get("mlflow.data.context") == "training"
    ]
    assert data_input.dataset.digest == manifest.hash == run.data.tags["data.hash"]
    counts = {t.key: t.value for t in data_input.tags}
    assert counts["train.documents"] == str(manifest.splits["train"].documents)
    assert not [k for k in run.data.metrics if k.startswith("data.")]


@pytest.mark.slow
def test_the_run_opens_in_the_model_training_view_with_its_lineage(first):
    run, summary = first["run"], first["summary"]
    exp = first["client"].get_experiment(run.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # the model-training view
    assert summary["mlflow_experiment_id"] == run.info.experiment_id  # `difflm run` prints the run's UI link
    assert json.loads(exp.tags[f"mlflow.sharedViewState.{run.info.run_id}"]) == training_view(
        run.info.run_id
    )  # the view the printed link opens: the curves first (tests/integration/test_ui_browser.py renders it)
    assert run.data.tags["prefect.flow_run_id"] and run.data.tags["mlflow.source.git.commit"]
    assert run.data.tags.get("prefect.flow_run_url", "http").startswith("http")  # a link, or none at all


@pytest.mark.slow
def test_a_nested_run_per_stage_with_live_curves_and_system_metrics(first):
    client, children, summary = first["client"], first["children"], first["summary"]
    assert set(children) == set(STAGES)
    assert all(c.info.status == "FINISHED" and c.data.tags["cached"] == "false" for c in children.values())
    train_run = children["train"]
    assert len(client.get_metric_history(train_run.info.run_id, "loss")) >= 3
    assert any(k.startswith("system/") for k in train_run.data.metrics), train_run.data.metrics.keys()
    assert "eval.trained.nll_per_token" in children["evaluate"].data.metrics
    assert children["train"].data.tags["train.run_dir"] == summary["run_dir"]
    assert children["convert"].data.tags["export.hf_dir"] == summary["hf_dir"]


@pytest.mark.slow
def test_a_markdown_summary_per_stage_in_prefect(first):
    train_md = Artifact.get("train-summary")
    assert train_md and "loss" in train_md.data and Path(first["summary"]["run_dir"]).name in train_md.data
    assert first["manifest"].hash in Artifact.get("data-prep-summary").data
    assert "nats/token" in Artifact.get("evaluate-summary").data


@pytest.mark.slow
def test_artifacts_and_the_export_in_mlflow(first):
    client, run = first["client"], first["run"]
    assert {"config", "data", "eval", "hf_model", "train"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    hf_files = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "hf_model")}
    assert {"model.safetensors", "config.json", "modeling_difflm.py", "tokenizer.json"} <= hf_files


@pytest.mark.slow
def test_the_first_version_is_candidate_and_champion(first):
    client, run, summary = first["client"], first["run"], first["summary"]
    assert summary["registered_model"] == "difflm-test-tiny-difflm-noshift-enwiki"
    version = client.get_model_version(summary["registered_model"], summary["version"])
    assert version.run_id == run.info.run_id and set(version.aliases) == {"candidate", "champion"}
    assert summary["promoted"] and "eval.trained.nll_per_token" in version.tags["promotion"]
    assert f"runs:/{run.info.run_id}" in version.description


@pytest.mark.slow
def test_a_rerun_reuses_everything(first):
    client, summary = first["client"], first["summary"]
    again = pretrain_difflm(config=first["cfg"])
    assert again["run_dir"] == summary["run_dir"] and again["mlflow_run_id"] != summary["mlflow_run_id"]
    assert again["validation"]["trained"]["nll_per_token"] == pytest.approx(
        summary["validation"]["trained"]["nll_per_token"]
    )
    assert len(client.get_metric_history(again["mlflow_run_id"], "loss")) >= 3  # curves backfilled
    assert again["version"] == summary["version"]  # same checkpoint: the same registered version
    assert again["stages"] == dict.fromkeys(STAGES, "cached")
    assert "hf_model" not in {a.path for a in client.list_artifacts(again["mlflow_run_id"])}  # no second upload
    assert "Prefect cache" in Artifact.get("train-summary").data


@pytest.mark.slow
def test_a_changed_input_reruns_only_what_depends_on_it(first, session_dir):
    changed_eval = pretrain_difflm(config=tiny_config(session_dir / "flow", *FLOW, "eval.task_items=2"))
    assert changed_eval["stages"] == {"data-prep": "cached", "train": "cached", "convert": "cached", "evaluate": "ran"}
    changed_train = pretrain_difflm(
        config=tiny_config(session_dir / "flow", "train.train_iters=20", "train.optimizer.lr=5e-3")
    )
    assert changed_train["stages"] == {"data-prep": "cached", "train": "ran", "convert": "ran", "evaluate": "ran"}
    assert changed_train["run_dir"] != first["summary"]["run_dir"]


@pytest.mark.slow
def test_the_evaluate_flow_on_the_registered_champion(first, session_dir, capfd, caplog):
    client, summary = first["client"], first["summary"]
    ev_cfg = tiny_config(session_dir / "flow", *FLOW, "eval.steps_sweep=[1,2]")
    res = evaluate(source=f"models:/{summary['registered_model']}@champion", config=ev_cfg)
    ev_run = client.get_run(res["mlflow_run_id"])
    assert ev_run.data.tags["flow"] == "evaluate" and "eval.cloze.acc" in ev_run.data.metrics
    assert [m.step for m in client.get_metric_history(ev_run.info.run_id, "sweep.tokens_per_s")] == [1, 2]
    ev_files = {a.path for a in client.list_artifacts(ev_run.info.run_id, "eval")}
    assert {"eval/samples.json", "eval/sweep.png", "eval/results.json"} <= ev_files
    assert res["samples"] and res["samples"][0]["sampler"]["mode"] == "difflm-noshift"
    # a line per sweep setting as it is measured (on stderr, or in the task's log under Prefect's log_prints)
    err = capfd.readouterr().err + caplog.text
    assert "[sweep] 1/2: 1 steps, accuracy" in err and "[sweep] 2/2: 2 steps" in err


def test_data_prep_flow_logs_statistics(session_dir, prefect_harness, tiny_manifest):
    cfg = tiny_config(session_dir / "shared")  # the same config as tiny_manifest: the prep is reused
    manifest = data_prep(config=cfg)
    assert manifest.hash == tiny_manifest.hash
    mlflow.set_tracking_uri(tracking_uri(cfg))
    runs = MlflowClient().search_runs(
        [mlflow.get_experiment_by_name(cfg.tracking.experiment).experiment_id], filter_string="tags.flow = 'data-prep'"
    )
    (data_input,) = runs[0].inputs.dataset_inputs
    assert data_input.dataset.digest == manifest.hash and data_input.dataset.name == "enwiki"
    counts = {t.key: t.value for t in data_input.tags}
    assert counts["train.enwiki.documents"] == str(manifest.splits["train"].sources["enwiki"]["documents"])
    assert json.loads(data_input.dataset.source)["uri"].endswith(manifest.hash)
