"""The runner's MLflow credentials go only to the server they belong to ($MLFLOW_TRACKING_URI): a preset, a study
spec or a deployment's overrides naming another `tracking.tracking_uri` is refused, in one line, before any request
(issue 50, item 3: a listener used to receive `Authorization: Basic admin:...` over plain HTTP)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from difflm import tracking
from difflm.config import load_config, study_spec
from difflm.credentials import ForeignTrackingServer
from difflm.flows.study import run_study
from difflm.tracking.mlflow_runs import CHOSEN_VAR

HOME = "http://127.0.0.1:9/mlflow"  # the server the credentials are for (never contacted here)
ROOT = Path(__file__).resolve().parents[2]


class Listener:
    """A plain HTTP server on a free local port that records every request it gets (and answers 404)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, str]] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                seen.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_PATCH = do_DELETE = _record

            def log_message(self, *args) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def credentials(monkeypatch) -> None:
    """The runner's environment: a tracking server and its credentials (as the stack's client.env sets them)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", HOME)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-admin-pw")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the unpatched code: one request is enough
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.delenv(CHOSEN_VAR, raising=False)


def _start_run(cfg) -> None:
    with tracking.degradations(), tracking.pipeline_run(cfg, "attack", {}):
        pass


def _refused(listener: Listener, err: pytest.ExceptionInfo) -> None:
    msg = str(err.value)
    assert "\n" not in msg and listener.url in msg and HOME in msg, msg
    assert "MLFLOW_TRACKING_USERNAME" in msg and "unset" in msg, msg
    assert "s3cret-admin-pw" not in msg
    assert listener.requests == [], listener.requests  # no request at all, so no Authorization header either


def test_a_preset_naming_another_tracking_server_is_refused_before_any_request(tmp_path, listener, credentials):
    preset = yaml.safe_load((ROOT / "configs" / "test-tiny.yaml").read_text())
    preset["tracking"] = {"tracking_uri": listener.url}
    path = tmp_path / "shared-preset.yaml"
    path.write_text(yaml.safe_dump(preset))
    cfg = load_config(str(path), [f"workdir={tmp_path / 'work'}"])
    with pytest.raises(ForeignTrackingServer) as err:
        _start_run(cfg)
    _refused(listener, err)


def test_a_deployments_overrides_naming_another_tracking_server_are_refused(tmp_path, listener, credentials):
    # what a deployment's `overrides` parameter becomes (flows/pretrain.resolve: load_config(preset, overrides))
    cfg = load_config("test-tiny", [f"workdir={tmp_path / 'work'}", f"tracking.tracking_uri={listener.url}/"])
    with pytest.raises(ForeignTrackingServer) as err:
        _start_run(cfg)
    _refused(listener, err)
    with pytest.raises(ForeignTrackingServer):  # the evaluation of models:/... resolves the same URI
        tracking.tracking_uri(cfg)
    assert listener.requests == []


def test_a_study_spec_naming_another_tracking_server_is_refused(tmp_path, listener, credentials):
    spec = {
        "name": "shared",
        "preset": "test-tiny",
        "base": [f"workdir={tmp_path / 'work'}", f"tracking.tracking_uri={listener.url}"],
        "families": {"masked": ["diffusion.model_running_mode=difflm-noshift"]},
        "unique_tokens": [2000],
        "epochs": {2000: [1]},
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = study_spec(path)
    points = loaded.points()
    with pytest.raises(ForeignTrackingServer) as err:
        with tracking.degradations(), tracking.study_run(points[0].cfg, loaded.name, {}):
            pass
    _refused(listener, err)
    said: list[str] = []
    with pytest.raises(ForeignTrackingServer):  # the study flow: before its first point (or line) starts
        run_study(loaded, said.append)
    assert said == [] and listener.requests == []


def test_the_credentials_own_server_a_local_store_or_no_credentials_pass(tmp_path, listener, credentials, monkeypatch):
    work = f"workdir={tmp_path / 'work'}"
    same = load_config("test-tiny", [work, f"tracking.tracking_uri={HOME}/"])  # the same server, spelt with a '/'
    assert tracking.tracking_uri(same) == HOME  # the environment's spelling: use_store keeps it the user's
    local = load_config("test-tiny", [work, f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db"])
    assert tracking.tracking_uri(local) == f"sqlite:///{tmp_path}/mlflow.db"  # no request carries credentials
    other = load_config("test-tiny", [work, f"tracking.tracking_uri={listener.url}"])
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "")  # empty: not sent
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    assert tracking.tracking_uri(other) == listener.url
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "t0ken")  # a token is a credential as well
    with pytest.raises(ForeignTrackingServer, match="MLFLOW_TRACKING_TOKEN"):
        tracking.tracking_uri(other)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # credentials for no server named here: no config's server gets them
    with pytest.raises(ForeignTrackingServer, match="MLFLOW_TRACKING_URI is not set"):
        tracking.tracking_uri(other)
    assert listener.requests == []
