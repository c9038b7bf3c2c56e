"""Who may write to a registered model decides whether its versions are loaded, and the server's records say it,
not the versions' tags: on a real MLflow server with basic auth, a second user puts her own export (digests that
match it, a forged `difflm.registered_by=admin` tag, the alias `champion`) behind the pipeline's model name,
either by creating that name first or by being granted EDIT on it. `difflm eval models:/NAME@champion`, run as the
pipeline user, refuses it in one line and downloads nothing; the pipeline refuses to register into the name."""

from __future__ import annotations

import json
import secrets

import mlflow.artifacts
import mlflow.tracking._tracking_service.utils as uri_state
import pytest
import requests
from helpers import fake_export
from mlflow.tracking import MlflowClient

from difflm import tracking
from difflm.config import TrackingConfig, load_config
from difflm.flows.cli import main
from difflm.tracking import registry

pytestmark = pytest.mark.integration  # a real MLflow server

ADMIN, OTHER = "admin", "mallory"
PERMISSIONS = "/api/3.0/mlflow/users/permissions"


def _as(monkeypatch, user: str, password: str) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)


@pytest.fixture
def two_users(tmp_path, monkeypatch, mlflow_server):
    """(server URL, {user: password}, the config): the admin (the pipeline user) and mallory, a plain user; every
    download is recorded (a refused version must not be fetched at all)."""
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.setenv(key, "")  # records the original (unset) value for teardown ...
        monkeypatch.delenv(key)
    monkeypatch.setattr(uri_state, "_tracking_uri", uri_state._tracking_uri)
    pw = {ADMIN: secrets.token_urlsafe(16), OTHER: secrets.token_urlsafe(16)}
    base = mlflow_server(admin_password=pw[ADMIN]).url
    made = requests.post(
        f"{base}/api/2.0/mlflow/users/create",
        json={"username": OTHER, "password": pw[OTHER]},
        auth=(ADMIN, pw[ADMIN]),
        timeout=30,
    )
    assert made.ok, made.text
    downloads, real = [], mlflow.artifacts.download_artifacts

    def recorded(*args, **kwargs):
        downloads.append(kwargs.get("artifact_uri") or args)
        return real(*args, **kwargs)

    monkeypatch.setattr(mlflow.artifacts, "download_artifacts", recorded)
    cfg = load_config("test-tiny", [f"workdir={tmp_path / 'work'}", f"tracking.tracking_uri={base}"])
    return base, pw, cfg, downloads


def _plant(client: MlflowClient, name: str, folder, create: bool) -> str:
    """Her export as a version of `name` with a forged owner tag and her own digests, aliased champion."""
    run = client.create_run(client.create_experiment(f"hers-{secrets.token_hex(4)}"))
    export = fake_export(folder)
    client.log_artifacts(run.info.run_id, str(export), "hf_model")
    if create:
        client.create_registered_model(name)
    tags = {registry.TAG_FILES: json.dumps(registry.export_digests(export)), registry.TAG_OWNER: ADMIN}
    mv = client.create_model_version(
        name, source=f"{run.info.artifact_uri}/hf_model", run_id=run.info.run_id, tags=tags
    )
    client.set_registered_model_alias(name, "champion", mv.version)
    return str(mv.version)


def _eval_refused(name: str, base: str, capsys) -> str:
    capsys.readouterr()
    code = main(["eval", f"models:/{name}@champion", "--tracking-uri", base, "--preset", "test-tiny"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    return err[0]


def _grant(base: str, pw: dict, user: str, name: str, permission: str) -> None:
    granted = requests.post(
        f"{base}{PERMISSIONS}/grant",
        json={"username": user, "resource_type": "registered_model", "resource_id": name, "permission": permission},
        auth=(ADMIN, pw[ADMIN]),
        timeout=30,
    )
    assert granted.ok, granted.text


def test_a_name_another_user_created_is_refused_despite_a_forged_owner_tag(two_users, tmp_path, monkeypatch, capsys):
    base, pw, cfg, downloads = two_users
    name = registry.registered_model_name(cfg)
    _as(monkeypatch, OTHER, pw[OTHER])
    version = _plant(MlflowClient(base), name, tmp_path / "hers", create=True)

    # the pipeline user evaluates the champion: refused before anything is downloaded or evaluated
    _as(monkeypatch, ADMIN, pw[ADMIN])
    line = _eval_refused(name, base, capsys)
    assert f"registered model '{name}'" in line and "refused" in line, line
    assert f"not created by the pipeline user '{ADMIN}'" in line and OTHER in line, line
    assert downloads == [] and not (tmp_path / "work" / "evals").exists()

    # the pipeline refuses to register into her name (nothing is added to it)
    with pytest.raises(registry.UntrustedModel, match=f"registering into registered model '{name}'.*refused"):
        registry.register_version(
            cfg, name, source="file:///nowhere", run_id="0" * 32, checkpoint="ckpt", uri=base, hf_dir=None
        )
    assert [str(v.version) for v in MlflowClient(base).search_model_versions(f"name='{name}'")] == [version]

    # trusted on purpose: the pipeline user takes MANAGE of it and names her as trusted; loaded, digests checked
    _grant(base, pw, ADMIN, name, "MANAGE")
    with pytest.raises(registry.UntrustedModel, match=rf"{OTHER} \(MANAGE\) may also write to it"):
        tracking.download_model_version(f"models:/{name}@champion", base)
    folder = tracking.download_model_version(
        f"models:/{name}@champion", base, TrackingConfig(trusted_registrants=[OTHER])
    )
    assert registry.export_digests(folder) == registry.export_digests(tmp_path / "hers")


def test_a_user_granted_edit_on_the_pipelines_model_is_refused(two_users, tmp_path, monkeypatch, capsys):
    base, pw, cfg, downloads = two_users
    name = registry.registered_model_name(cfg)
    _as(monkeypatch, ADMIN, pw[ADMIN])
    ours = _plant(MlflowClient(base), name, tmp_path / "ours", create=True)  # the pipeline's own name and version
    assert tracking.download_model_version(f"models:/{name}@champion", base) and len(downloads) == 1
    mine = MlflowClient(base).get_model_version(name, ours)  # the pipeline registers into its own name
    again = registry.register_version(cfg, name, source=mine.source, run_id=mine.run_id, checkpoint="ckpt", uri=base)
    assert again["version"] != ours and again["registered_by"] == ADMIN

    _grant(base, pw, OTHER, name, "EDIT")
    _as(monkeypatch, OTHER, pw[OTHER])
    hers = _plant(MlflowClient(base), name, tmp_path / "hers", create=False)
    assert hers != ours

    _as(monkeypatch, ADMIN, pw[ADMIN])
    line = _eval_refused(name, base, capsys)
    assert f"registered model '{name}'" in line and f"{OTHER} (EDIT) may also write to it" in line, line
    assert "tracking.trusted_registrants" in line and len(downloads) == 1
    with pytest.raises(registry.UntrustedModel, match="registering into"):
        registry.register_version(cfg, name, source=mine.source, run_id=mine.run_id, checkpoint="ckpt2", uri=base)
    assert len(MlflowClient(base).search_model_versions(f"name='{name}'")) == 3
