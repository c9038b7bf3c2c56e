"""Who registered a version decides whether it is loaded: on a real MLflow server with basic auth, a second user
puts her own export behind the pipeline's model name (her version carries file digests that match it, and the
alias `champion`); `difflm eval models:/NAME@champion`, run as the pipeline user, refuses it in one line and
downloads nothing, and loads it once that user is in tracking.trusted_registrants."""

from __future__ import annotations

import json
import secrets

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


def _as(monkeypatch, user: str, password: str) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)


def test_a_version_registered_by_another_user_is_refused_by_default(tmp_path, monkeypatch, mlflow_server, capsys):
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.setenv(key, "")  # records the original (unset) value for teardown ...
        monkeypatch.delenv(key)
    monkeypatch.setattr(uri_state, "_tracking_uri", uri_state._tracking_uri)
    admin_pw, other_pw = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    base = mlflow_server(admin_password=admin_pw).url
    made = requests.post(
        f"{base}/api/2.0/mlflow/users/create",
        json={"username": OTHER, "password": other_pw},
        auth=(ADMIN, admin_pw),
        timeout=30,
    )
    assert made.ok, made.text
    cfg = load_config("test-tiny", [f"workdir={tmp_path / 'work'}", f"tracking.tracking_uri={base}"])
    name = registry.registered_model_name(cfg)

    # the other user, in her own experiment: the pipeline's model name, her export, digests that match it
    _as(monkeypatch, OTHER, other_pw)
    client = MlflowClient(base)
    run = client.create_run(client.create_experiment("hers"))
    export = fake_export(tmp_path / "hers")
    client.log_artifacts(run.info.run_id, str(export), "hf_model")
    client.create_registered_model(name)
    tags = {registry.TAG_FILES: json.dumps(registry.export_digests(export)), registry.TAG_OWNER: OTHER}
    mv = client.create_model_version(
        name, source=f"{run.info.artifact_uri}/hf_model", run_id=run.info.run_id, tags=tags
    )
    client.set_registered_model_alias(name, "champion", mv.version)

    # the pipeline user evaluates the champion: refused before anything is downloaded or evaluated
    _as(monkeypatch, ADMIN, admin_pw)
    capsys.readouterr()
    code = main(["eval", f"models:/{name}@champion", "--tracking-uri", base, "--preset", "test-tiny"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert f"was registered by {OTHER}, not by the pipeline user '{ADMIN}': refused" in err[0]
    assert "tracking.trusted_registrants" in err[0] and not (tmp_path / "work" / "evals").exists()

    # a forged-looking version without the owner tag is refused the same way
    del tags[registry.TAG_OWNER]
    bare = client.create_model_version(
        name, source=f"{run.info.artifact_uri}/hf_model", run_id=run.info.run_id, tags=tags
    )
    with pytest.raises(registry.UntrustedVersion, match="registered by an unknown user"):
        tracking.download_model_version(f"models:/{name}/{bare.version}", base)

    # trusted on purpose: loaded, its files checked against the digests
    folder = tracking.download_model_version(
        f"models:/{name}@champion", base, TrackingConfig(trusted_registrants=[OTHER])
    )
    assert registry.export_digests(folder) == registry.export_digests(export)
