"""The flagship flow end to end on the test-tiny preset, on a real Prefect server and MLflow store."""

import json
from pathlib import Path

import pytest
from conftest import tiny_config


@pytest.mark.slow
def test_pretrain_difflm_end_to_end_and_rerun(session_dir, prefect_harness, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient
    from prefect.artifacts import Artifact

    from difflm.tracking import tracking_uri
    from flows.pretrain import pretrain_difflm
    from models.hf.convert import load_hf

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")  # samples within a short training
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")
    cfg = tiny_config(session_dir / "flow", "train.train_iters=30", "train.lr=5e-3")
    summary = pretrain_difflm(config=cfg)
    assert summary["stages"] == dict.fromkeys(("data-prep", "train", "convert", "evaluate"), "ran")

    # data, checkpoint, HF export that transformers loads offline
    assert (Path(summary["data_dir"]) / "manifest.json").exists()
    assert (Path(summary["run_dir"]) / "checkpoints" / "iter_0000030" / "metadata.json").exists()
    model = load_hf(Path(summary["hf_dir"]))
    assert (
        model.config.mask_token_id
        == json.loads((Path(summary["data_dir"]) / "manifest.json").read_text())["tokenizer"]["mask_id"]
    )

    # training helped: the bound of the trained model is below the untrained one
    v = summary["validation"]
    assert v["trained"]["bound"] and v["trained"]["nll_per_token"] < v["untrained"]["nll_per_token"]
    assert summary["samples"] and summary["samples"][0]["sampler"]["steps"] == cfg.eval.sampler.steps

    # one MLflow run with params, curves, data stats, samples, the model, a registered version
    mlflow.set_tracking_uri(tracking_uri(cfg))
    client = MlflowClient()
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["train.train_iters"] == "30"
    assert run.data.params["diffusion.model_running_mode"] == "difflm-noshift"
    assert len(client.get_metric_history(run.info.run_id, "loss")) >= 3
    assert len(client.get_metric_history(run.info.run_id, "val_loss")) >= 2
    # the data as a dataset input (digest = data hash, counts as input tags), not as single-point metrics
    (data_input,) = [
        d
        for d in run.inputs.dataset_inputs
        if {t.key: t.value for t in d.tags}.get("mlflow.data.context") == "training"
    ]
    manifest = json.loads((Path(summary["data_dir"]) / "manifest.json").read_text())
    assert data_input.dataset.digest == manifest["hash"] == run.data.tags["data.hash"]
    counts = {t.key: t.value for t in data_input.tags}
    assert counts["train.documents"] == str(manifest["splits"]["train"]["documents"])
    assert not [k for k in run.data.metrics if k.startswith("data.")]
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # the model-training view
    assert run.data.tags["prefect.flow_run_id"] and run.data.tags["mlflow.source.git.commit"]
    # a nested run per stage: live training curves and system metrics in the train stage's run
    children = {
        r.data.tags["stage"]: r
        for r in client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    }
    assert set(children) == {"data-prep", "train", "convert", "evaluate"}
    assert all(c.info.status == "FINISHED" and c.data.tags["cached"] == "false" for c in children.values())
    train_run = children["train"]
    assert len(client.get_metric_history(train_run.info.run_id, "loss")) >= 3
    assert any(k.startswith("system/") for k in train_run.data.metrics), train_run.data.metrics.keys()
    assert "eval.trained.nll_per_token" in children["evaluate"].data.metrics
    assert children["train"].data.tags["train.run_dir"] == summary["run_dir"]
    assert children["convert"].data.tags["export.hf_dir"] == summary["hf_dir"]
    # a markdown summary per stage in Prefect
    train_md = Artifact.get("train-summary")
    assert train_md and "loss" in train_md.data and Path(summary["run_dir"]).name in train_md.data
    assert manifest["hash"] in Artifact.get("data-prep-summary").data
    assert "nats/token" in Artifact.get("evaluate-summary").data
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config", "data", "eval", "hf_model", "train"} <= artifacts
    hf_files = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "hf_model")}
    assert {"model.safetensors", "config.json", "modeling_difflm.py", "tokenizer.json"} <= hf_files
    # registered under the name derived from preset and mode; the first version is candidate and champion
    assert summary["registered_model"] == "difflm-test-tiny-difflm-noshift-enwiki"
    version = client.get_model_version(summary["registered_model"], summary["version"])
    assert version.run_id == run.info.run_id and set(version.aliases) == {"candidate", "champion"}
    assert summary["promoted"] and "eval.trained.nll_per_token" in version.tags["promotion"]
    assert f"runs:/{run.info.run_id}" in version.description

    # running it again reuses what is done: same checkpoint, a new MLflow run with backfilled curves
    again = pretrain_difflm(config=cfg)
    assert again["run_dir"] == summary["run_dir"] and again["mlflow_run_id"] != summary["mlflow_run_id"]
    assert again["validation"]["trained"]["nll_per_token"] == pytest.approx(v["trained"]["nll_per_token"])
    assert len(client.get_metric_history(again["mlflow_run_id"], "loss")) >= 3
    assert again["version"] == summary["version"]  # same checkpoint: the same registered version
    assert again["stages"] == dict.fromkeys(("data-prep", "train", "convert", "evaluate"), "cached")
    assert "hf_model" not in {a.path for a in client.list_artifacts(again["mlflow_run_id"])}  # no second upload
    assert run.data.tags.get("prefect.flow_run_url", "http").startswith("http")  # a link, or none at all
    assert "Prefect cache" in Artifact.get("train-summary").data

    # a changed input reruns only the stages that depend on it
    changed_eval = pretrain_difflm(
        config=tiny_config(session_dir / "flow", "train.train_iters=30", "train.lr=5e-3", "eval.task_items=2")
    )
    assert changed_eval["stages"] == {"data-prep": "cached", "train": "cached", "convert": "cached", "evaluate": "ran"}
    changed_train = pretrain_difflm(config=tiny_config(session_dir / "flow", "train.train_iters=20", "train.lr=5e-3"))
    assert changed_train["stages"] == {"data-prep": "cached", "train": "ran", "convert": "ran", "evaluate": "ran"}
    assert changed_train["run_dir"] != summary["run_dir"]

    # the evaluate flow on the registered version: its own MLflow run with task metrics, samples, a sweep
    from flows.evaluate import evaluate

    ev_cfg = tiny_config(session_dir / "flow", "train.train_iters=30", "train.lr=5e-3", "eval.steps_sweep=[1,2]")
    res = evaluate(source=f"models:/{summary['registered_model']}@champion", config=ev_cfg)
    ev_run = client.get_run(res["mlflow_run_id"])
    assert ev_run.data.tags["flow"] == "evaluate" and "eval.cloze.acc" in ev_run.data.metrics
    assert [m.step for m in client.get_metric_history(ev_run.info.run_id, "sweep.tokens_per_s")] == [1, 2]
    ev_files = {a.path for a in client.list_artifacts(ev_run.info.run_id, "eval")}
    assert {"eval/samples.json", "eval/sweep.png", "eval/results.json"} <= ev_files
    assert res["samples"] and res["samples"][0]["sampler"]["mode"] == "difflm-noshift"


def test_data_prep_flow_logs_statistics(session_dir, prefect_harness, tiny_manifest):
    import mlflow
    from mlflow.tracking import MlflowClient

    from difflm.tracking import tracking_uri
    from flows.data_prep import data_prep

    cfg = tiny_config(session_dir / "shared")  # the same config as tiny_manifest: the prep is reused
    manifest = data_prep(config=cfg)
    assert manifest["hash"] == tiny_manifest["hash"]
    mlflow.set_tracking_uri(tracking_uri(cfg))
    runs = MlflowClient().search_runs(
        [mlflow.get_experiment_by_name(cfg.tracking.experiment).experiment_id], filter_string="tags.flow = 'data-prep'"
    )
    (data_input,) = runs[0].inputs.dataset_inputs
    assert data_input.dataset.digest == manifest["hash"] and data_input.dataset.name == "enwiki"
    counts = {t.key: t.value for t in data_input.tags}
    assert counts["train.enwiki.documents"] == str(manifest["splits"]["train"]["sources"]["enwiki"]["documents"])
    assert json.loads(data_input.dataset.source)["uri"].endswith(manifest["hash"])
