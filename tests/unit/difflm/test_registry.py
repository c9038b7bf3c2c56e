"""The model registry rules on a real MLflow sqlite store: names per preset and mode, `candidate` on every new
version, `champion` only when the configured metric is strictly better, readable descriptions."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

import mlflow
import pytest
from helpers import fake_export, manifest_record
from mlflow.tracking import MlflowClient

from difflm import tracking
from difflm.config import load_config
from difflm.manifest import DataManifest
from difflm.tracking import registry

pytestmark = pytest.mark.integration  # MLflow stores and registries

METRIC = "eval.trained.nll_per_token"
MANIFEST = manifest_record("abc123def456", "/data/abc123def456", sources=({"name": "enwiki"},))


def results(nll: float) -> dict:
    return {
        "bounds": {"trained": {"nll_per_token": nll, "ppl": 2.718**nll, "bound": True, "kind": "elbo"}},
        "tasks": {"cloze": {"acc": 0.25, "nll": 3.5, "items": 6}},
    }


@pytest.fixture
def store(tmp_path, monkeypatch):
    """(uri, client, experiment id) of a fresh sqlite store with its artifacts in tmp_path."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # records the original (unset) value for teardown ...
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # ... which mlflow.set_tracking_uri would otherwise leak
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("reg", artifact_location=(tmp_path / "artifacts").as_uri())
    return uri, client, exp


def register(store, cfg, tmp_path, value: float | None, checkpoint: str, manifest: DataManifest = MANIFEST) -> dict:
    """A run that logged `value` of the champion metric and a dummy export, registered like the flow does."""
    uri, client, exp = store
    run = client.create_run(exp)
    if value is not None:
        client.log_metric(run.info.run_id, cfg.tracking.champion_metric, value)
    client.log_metric(run.info.run_id, "val_loss", 5.0)
    hf = fake_export(tmp_path / checkpoint.replace("/", "_"))
    client.log_artifacts(run.info.run_id, str(hf), "hf_model")
    client.set_terminated(run.info.run_id)
    name = registry.registered_model_name(cfg)
    return registry.register_version(
        cfg,
        name,
        source=f"{run.info.artifact_uri}/hf_model",
        run_id=run.info.run_id,
        checkpoint=checkpoint,
        uri=uri,
        hf_dir=hf,
        manifest=manifest,
        results=results(value or 0.0),
    )


def aliases(client, name: str) -> dict[str, str]:
    return {alias: str(v) for alias, v in client.get_registered_model(name).aliases.items()}


def test_default_name_per_preset_and_mode_and_an_explicit_override():
    assert registry.registered_model_name(load_config("tiny-cpu")) == "difflm-tiny-cpu-difflm-noshift-enwiki"
    assert (
        registry.registered_model_name(load_config("test-tiny", ["diffusion.model_running_mode=ar"]))
        == "difflm-test-tiny-ar-enwiki"
    )
    odd = load_config("test-tiny", ["name=my run/v2"])  # sanitised to MLflow-safe characters
    assert registry.registered_model_name(odd) == "difflm-my-run-v2-difflm-noshift-enwiki"
    assert registry.registered_model_name(load_config("test-tiny", ["tracking.registered_model=mine"])) == "mine"
    assert registry.registered_model_name(load_config("test-tiny", ["tracking.registry=false"])) is None
    assert registry.registered_model_name(load_config("test-tiny", ["tracking.registered_model="])) is None


def test_champion_moves_only_to_a_strictly_better_version(store, tmp_path):
    _, client, _ = store
    cfg = load_config("test-tiny", [f"workdir={tmp_path}"])
    name = registry.registered_model_name(cfg)

    first = register(store, cfg, tmp_path, 6.90, "ckpt/1")
    assert first["promoted"] and first["version"] == "1" and sorted(first["aliases"]) == ["candidate", "champion"]
    assert aliases(client, name) == {"candidate": "1", "champion": "1"}

    worse = register(store, cfg, tmp_path, 7.10, "ckpt/2")
    assert not worse["promoted"] and worse["champion_version"] == "1" and worse["aliases"] == ["candidate"]
    assert aliases(client, name) == {"candidate": "2", "champion": "1"}
    tags = client.get_model_version(name, "2").tags
    assert tags["promotion"] == f"kept champion v1 ({METRIC} 7.1 >= 6.9)"
    assert tags["champion_metric"] == METRIC and float(tags["champion_metric_value"]) == 7.10

    equal = register(store, cfg, tmp_path, 6.90, "ckpt/3")  # a tie is not better
    assert not equal["promoted"] and aliases(client, name) == {"candidate": "3", "champion": "1"}

    better = register(store, cfg, tmp_path, 6.65, "ckpt/4")
    assert better["promoted"] and aliases(client, name) == {"candidate": "4", "champion": "4"}
    assert client.get_model_version(name, "4").tags["promotion"] == f"champion ({METRIC} 6.65 < 6.9 of v1)"

    missing = register(store, cfg, tmp_path, None, "ckpt/5")  # evaluation not logged: never promoted
    assert not missing["promoted"] and "no eval.trained.nll_per_token logged" in missing["promotion"]
    assert aliases(client, name) == {"candidate": "5", "champion": "4"}


def test_versions_on_other_data_never_compete_for_champion(store, tmp_path):
    """Tried as a new user would: own-data models became versions of the demo's model and promotion compared
    ELBOs across corpora and tokenizers ("kept champion v1 (6.669 >= 6.56)")."""
    _, client, _ = store
    demo = load_config("test-tiny", [f"workdir={tmp_path}"])
    own = load_config("test-tiny", [f"workdir={tmp_path}", "data.sources=[/data/docstrings.jsonl, /data/changelogs/]"])
    assert registry.registered_model_name(own) == "difflm-test-tiny-difflm-noshift-docstrings-changelogs"
    assert registry.registered_model_name(own) != registry.registered_model_name(demo)

    # one explicit name for both (tracking.registered_model): the data hash still keeps them apart
    shared = [f"workdir={tmp_path}", "tracking.registered_model=shared"]
    first = register(store, load_config("test-tiny", shared), tmp_path, 6.90, "ckpt/1")
    other_data = MANIFEST.replace(hash="0123456789ab")
    lower = register(store, load_config("test-tiny", shared), tmp_path, 6.56, "ckpt/2", manifest=other_data)
    assert first["promoted"] and not lower["promoted"] and aliases(client, "shared")["champion"] == "1"
    assert "not compared, it was scored on other data" in lower["promotion"], lower["promotion"]
    same_data = register(store, load_config("test-tiny", shared), tmp_path, 6.80, "ckpt/3")
    assert same_data["promoted"] and aliases(client, "shared")["champion"] == "3"


def test_higher_is_better_reverses_the_comparison(store, tmp_path):
    _, client, _ = store
    cfg = load_config(
        "test-tiny",
        [
            f"workdir={tmp_path}",
            "tracking.champion_metric=eval.cloze.acc",
            "tracking.champion_higher_is_better=true",
            "tracking.registered_model=acc-model",
        ],
    )
    assert register(store, cfg, tmp_path, 0.50, "a")["promoted"]
    lower = register(store, cfg, tmp_path, 0.40, "b")
    assert not lower["promoted"] and lower["promotion"] == "kept champion v1 (eval.cloze.acc 0.4 <= 0.5)"
    assert register(store, cfg, tmp_path, 0.60, "c")["promoted"]
    assert aliases(client, "acc-model") == {"candidate": "3", "champion": "3"}


def test_the_same_checkpoint_reuses_its_version(store, tmp_path):
    _, client, _ = store
    cfg = load_config("test-tiny", [f"workdir={tmp_path}"])
    first = register(store, cfg, tmp_path / "1", 6.9, "ckpt")
    again = register(store, cfg, tmp_path / "2", 6.0, "ckpt")
    assert again["version"] == first["version"] == "1" and not again["promoted"]
    assert again["promotion"].startswith("reused v1") and again["aliases"] == ["candidate", "champion"]
    assert len(client.search_model_versions(f"name='{first['registered_model']}'")) == 1


def test_description_is_readable_and_links_back(store, tmp_path):
    _, client, _ = store
    cfg = load_config("test-tiny", [f"workdir={tmp_path}"])
    out = register(store, cfg, tmp_path, 6.9, "/runs/x/checkpoints/iter_0000020")
    mv = client.get_model_version(out["registered_model"], out["version"])
    text = mv.description
    assert text.startswith("**difflm-noshift** LM, preset `test-tiny`")
    assert "0.00M parameters" in text and "final val_loss 5.0000" in text
    assert "ELBO (upper bound): 6.9000 nats/token" in text and "task cloze: acc 0.250, nll 3.500 (6 items)" in text
    assert f"`{METRIC}` (lower is better): 6.9" in text
    assert f"run: `runs:/{mv.run_id}`" in text and f"`runs:/{mv.run_id}/data/manifest.json`" in text
    assert "abc123def456" in text and "enwiki" in text and "/runs/x/checkpoints/iter_0000020" in text
    assert {"mode": "difflm-noshift", "preset": "test-tiny", "data.hash": "abc123def456"}.items() <= mv.tags.items()
    assert registry.parameter_count(tmp_path / "_runs_x_checkpoints_iter_0000020") == 44


def test_run_links_point_at_the_ui_of_a_server():
    assert registry.run_links("sqlite:///x.db", "3", "r1") == {"run": "runs:/r1"}
    ui = registry.run_links("http://127.0.0.1:5000/", "3", "r1")["ui"]
    assert ui == "http://127.0.0.1:5000/#/experiments/3/runs/r1?workflowType=machine_learning"


@pytest.mark.parametrize("off", ["tracking.registry=false", "tracking.registered_model="])
def test_disabled_registration_registers_nothing(store, tmp_path, off):
    uri, client, exp = store
    cfg = load_config("test-tiny", [f"workdir={tmp_path}", f"tracking.tracking_uri={uri}", off])
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=exp) as run:
        out = tracking.log_and_register_model(cfg, fake_export(tmp_path / "hf"), run.info.run_id, "ckpt")
    assert out and "artifact_uri" in out and "version" not in out
    assert client.search_registered_models() == []


def test_the_flow_wrapper_registers_under_the_derived_name(store, tmp_path):
    uri, client, exp = store
    cfg = load_config("test-tiny", [f"workdir={tmp_path}", f"tracking.tracking_uri={uri}"])
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=exp) as run:
        mlflow.log_metric(METRIC, 6.5)
        out = tracking.log_and_register_model(
            cfg, fake_export(tmp_path / "hf"), run.info.run_id, "ckpt", manifest=MANIFEST, results=results(6.5)
        )
    assert out["registered_model"] == "difflm-test-tiny-difflm-noshift-enwiki" and out["promoted"]
    owner = registry.pipeline_user(cfg.tracking)  # who registered it: on the version, in what the CLI prints
    assert (
        out["registered_by"] == owner
        and client.get_model_version(out["registered_model"], "1").tags[registry.TAG_OWNER] == owner
    )
    assert (
        client.get_run(run.info.run_id).data.tags["registered_model_version"]
        == "difflm-test-tiny-difflm-noshift-enwiki/1"
    )
    assert str(client.get_model_version_by_alias(out["registered_model"], "champion").version) == "1"


def test_a_tampered_registered_export_is_refused(store, tmp_path):
    """The review's registry poisoning: the files behind a registered version are replaced (here in the artifact
    store itself); downloading the version checks every file's SHA-256 recorded at registration."""
    uri, client, exp = store
    cfg = load_config("test-tiny", [f"workdir={tmp_path}", f"tracking.tracking_uri={uri}"])
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=exp) as run:
        mlflow.log_metric(METRIC, 6.5)
        out = tracking.log_and_register_model(
            cfg, fake_export(tmp_path / "hf"), run.info.run_id, "ckpt", manifest=MANIFEST, results=results(6.5)
        )
    ref = f"models:/{out['registered_model']}@champion"
    folder = tracking.download_model_version(ref, uri)
    assert json.loads(client.get_model_version(out["registered_model"], "1").tags[registry.TAG_FILES]) == (
        registry.export_digests(folder)
    )
    stored = Path(urlparse(client.get_run(run.info.run_id).info.artifact_uri).path) / "hf_model"
    assert stored.is_dir()
    (stored / "modeling_difflm.py").write_text("import os; os.system('id')\n")  # a payload planted in the export
    with pytest.raises(registry.ExportMismatch, match="modeling_difflm.py.*refused, nothing of it was loaded"):
        tracking.download_model_version(ref, uri)
    # a version registered without digests (by hand, or elsewhere) cannot be checked: refused too
    mv = client.create_model_version(out["registered_model"], source=str(stored), run_id=run.info.run_id)
    with pytest.raises(registry.ExportMismatch, match="records no file digests"):
        tracking.download_model_version(f"models:/{out['registered_model']}/{mv.version}", uri)
