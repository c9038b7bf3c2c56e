"""The MLflow UI as a user sees it: headless Chromium renders the run page and the model version page of a real
`mlflow server`, and the rendered DOM must show the training metrics, the dataset, the aliases and the lineage.

Chromium is the Debian package (`make test` installs it when run as root). Without it the test is skipped,
except under CI (`$CI` set), where a missing browser is a failure. Screenshots are kept beside the DOM dumps
in the test's tmp_path for debugging.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_registry import fake_export  # an HF-like folder, 44 parameters, no weights

from difflm.config import load_config

MANIFEST = {
    "hash": "feedc0ffee42",
    "dir": "/data/feedc0ffee42",
    "sources": [{"name": "enwiki"}],
    "tokenizer": {"vocab_size": 512},
    "splits": {"train": {"documents": 40, "tokens": 9000}, "valid": {"documents": 4, "tokens": 900}},
}
CHECKPOINT = "runs/ui-browser/iter_0000020"


def _chromium() -> str:
    """The browser's path; a skip (or, under CI, a failure) naming how to install it when it is missing."""
    path = shutil.which("chromium")
    if path:
        return path
    why = "chromium not installed (Debian: apt-get install chromium; `make test` does it when run as root)"
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the browser test: {why}")
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mlflow_server(store: Path, port: int) -> subprocess.Popen:
    """A real `mlflow server` on loopback (sqlite + a local artifact root), once /health answers."""
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job workers: ~0.5 GB, not ~2.4
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{store / 'mlflow.db'}",
            "--default-artifact-root",
            str(store / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120  # ~10 s here; a fresh sqlite store is migrated first, slow when loaded
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                return proc
        except OSError:
            time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"mlflow server on port {port} not healthy (exit code {proc.poll()})")


def _trained_and_registered(cfg, hf_dir: Path) -> dict:
    """A run as the pipeline makes it (config params, dataset input, loss/val_loss curves, evaluation) and its
    export registered through difflm.tracking: {run_id, experiment_id, registered_model, version, aliases}."""
    import mlflow

    from difflm import tracking

    results = {"bounds": {"trained": {"nll_per_token": 3.25, "ppl": 25.8, "bound": True}}, "tasks": {}}
    with tracking.pipeline_run(cfg, "ui-browser", {"stage": "train", "preset": cfg.name}) as run_id:
        assert run_id, tracking.DEGRADED
        tracking.log_data_stats(MANIFEST)
        for step in range(1, 21):
            mlflow.log_metric("loss", 6.0 - 0.1 * step, step=step)
            if step % 5 == 0:
                mlflow.log_metric("val_loss", 6.1 - 0.1 * step, step=step)
        tracking.log_evaluation(results)
        out = tracking.log_and_register_model(cfg, hf_dir, run_id, CHECKPOINT, manifest=MANIFEST, results=results)
    assert out and not tracking.DEGRADED, tracking.DEGRADED
    return {"run_id": run_id, "experiment_id": mlflow.get_run(run_id).info.experiment_id, **out}


def _render(chromium: str, url: str, out: Path, ready: tuple[str, ...]) -> tuple[str, str]:
    """(DOM, visible text) of `url` after the React app rendered it; the DOM at out.html, a screenshot at
    out.png. Virtual time only advances while no fetch is pending, so the budget is spent after the API
    answered; retried with a larger budget on a slow machine while a `ready` string is not in the DOM yet."""
    dom = ""
    for budget in (10000, 30000, 60000):
        cmd = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--disable-dev-shm-usage",
            f"--user-data-dir={out.parent / 'chromium-profile'}",
            "--window-size=1600,1400",
            f"--virtual-time-budget={budget}",
            f"--screenshot={out.with_suffix('.png')}",
            "--dump-dom",
            url,
        ]
        try:
            dom = subprocess.run(cmd, capture_output=True, text=True, timeout=90).stdout
        except subprocess.TimeoutExpired as err:
            dom = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        out.with_suffix(".html").write_text(dom)
        if all(r in dom for r in ready):
            break
    visible = re.sub(r"<(script|style|svg)\b.*?</\1>", " ", dom, flags=re.S)
    return dom, re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", visible)))


@pytest.mark.slow
def test_run_and_model_version_pages_show_metrics_aliases_and_lineage(tmp_path, monkeypatch):
    import mlflow.tracking._tracking_service.utils as uri_state

    chromium = _chromium()
    # the pipeline's mlflow.set_tracking_uri sets $MLFLOW_TRACKING_URI (and HTTP settings): undo after the test
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.setenv(key, "")  # records the original (unset) value for teardown ...
        monkeypatch.delenv(key)
    monkeypatch.setattr(uri_state, "_tracking_uri", uri_state._tracking_uri)

    port = _free_port()
    server = _mlflow_server(tmp_path / "mlflow", port)
    base = f"http://127.0.0.1:{port}"
    try:
        cfg = load_config(
            "test-tiny",
            [f"workdir={tmp_path / 'work'}", f"tracking.tracking_uri={base}", "tracking.experiment=ui-browser"],
        )
        reg = _trained_and_registered(cfg, fake_export(tmp_path / "hf"))
        run_id, exp, name, version = reg["run_id"], reg["experiment_id"], reg["registered_model"], reg["version"]
        assert sorted(reg["aliases"]) == ["candidate", "champion"], reg

        run_url = f"{base}/#/experiments/{exp}/runs/{run_id}"
        mv_link = f"#/models/{name}/versions/{version}"
        dom, text = _render(
            chromium, run_url, tmp_path / "run_page", ready=("eval.trained.nll_per_token", MANIFEST["dir"], mv_link)
        )
        where = f"on {run_url} (DOM and screenshot: {tmp_path / 'run_page'}.html/.png)"
        for metric in ("loss", "val_loss", "eval.trained.nll_per_token"):  # the training and evaluation metrics
            assert re.search(rf"(^|\s){re.escape(metric)}\s", text), f"metric {metric} not shown {where}"
        assert run_id in text and "model.hidden_size" in text, f"run id or config params not shown {where}"
        # the data it trained on: the dataset input (name, digest, context) and the data.hash tag
        assert re.search(rf"Datasets enwiki \({MANIFEST['hash']}\) training", text, re.I), f"no dataset {where}"
        assert f"data.hash : {MANIFEST['hash']}" in text, f"no data.hash tag {where}"
        # lineage: the run links to its registered version
        assert re.search(rf"Registered models {re.escape(name)} v{version}\b", text) and mv_link in dom, (
            f"no link to the registered version {where}"
        )

        mv_url = f"{base}/{mv_link}"
        dom, text = _render(
            chromium, mv_url, tmp_path / "version_page", ready=("candidate", "manifest.json", CHECKPOINT)
        )
        where = f"on {mv_url} (DOM and screenshot: {tmp_path / 'version_page'}.html/.png)"
        aliases = re.search(r"Aliases\s*:(.{0,120})", text)
        assert aliases and all(f"@ {a}" in aliases[1] for a in ("candidate", "champion")), f"no aliases {where}"
        assert f'href="#/experiments/{exp}/runs/{run_id}' in dom, f"no source run link {where}"
        # the description's lineage: the run (and its UI page), the data with its manifest, the checkpoint
        assert f"run: runs:/{run_id}" in text and f'href="{run_url}?workflowType=machine_learning"' in dom, (
            f"no run in the description {where}"
        )
        assert f"data: {MANIFEST['hash']} from enwiki" in text, f"no data in the description {where}"
        assert f"dataset: runs:/{run_id}/data/manifest.json" in text, f"no manifest link {where}"
        assert f"checkpoint: {CHECKPOINT}" in text and "final val_loss 4.1000" in text, f"no checkpoint {where}"
        assert f"data.hash {MANIFEST['hash']}" in text, f"no data.hash tag on the version {where}"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        shutil.rmtree(tmp_path / "chromium-profile", ignore_errors=True)  # 16 MB; the DOM dumps and screenshots stay
