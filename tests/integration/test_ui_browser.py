"""The MLflow UI as a user sees it: headless Chromium renders the pages of a real `mlflow server` running the
basic-auth app (as the stack does, through deploy.mlflow_auth), logged in with HTTP basic credentials, and the
rendered DOM must show the training metrics, the dataset, the aliases, the lineage, and the link `difflm run`
prints: the run in the model-training view with loss and val_loss on its first chart.

Chromium is the Debian package (`make test` installs it when run as root), driven over the DevTools protocol on a
pipe (no extra Python package). Without it the test is skipped, except under CI (`$CI` set), where a missing
browser is a failure. Screenshots are kept beside the DOM dumps in the test's tmp_path for debugging.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import mlflow.tracking._tracking_service.utils as uri_state
import pytest
from helpers import fake_export, manifest_record  # fake_export: an HF-like folder, 44 parameters, no weights

from difflm import tracking
from difflm.config import load_config
from difflm.manifest import SplitStats
from difflm.tasks.artifacts import mlflow_curves_url

MANIFEST = manifest_record(
    "feedc0ffee42",
    "/data/feedc0ffee42",
    sources=({"name": "enwiki"},),
    splits={"train": SplitStats(40, 9000), "valid": SplitStats(4, 900)},
)
CHECKPOINT = "runs/ui-browser/iter_0000020"
ROOT = Path(__file__).resolve().parents[2]
ADMIN = "admin"
RUN_NAME = "ui-browser"


def _chromium() -> str:
    """The browser's path; a skip (or, under CI, a failure) naming how to install it when it is missing."""
    path = shutil.which("chromium")
    if path:
        return path
    why = "chromium not installed (Debian: apt-get install chromium; `make test` does it when run as root)"
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the browser test: {why}")
    pytest.skip(why)


def _anonymous_status(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as err:
        return err.code


def _trained_and_registered(cfg, hf_dir: Path) -> dict:
    """A run as the pipeline makes it (config params, dataset input, loss/val_loss curves, evaluation) and its
    export registered through difflm.tracking: {run_id, experiment_id, registered_model, version, aliases}."""
    results = {"bounds": {"trained": {"nll_per_token": 3.25, "ppl": 25.8, "bound": True}}, "tasks": {}}
    with tracking.pipeline_run(cfg, RUN_NAME, {"stage": "train", "preset": cfg.name}) as run_id:
        assert run_id, tracking.DEGRADED
        tracking.share_training_view(run_id)  # as difflm.flows.pretrain does: the view the printed link opens
        tracking.log_data_stats(MANIFEST)
        for step in range(1, 21):
            mlflow.log_metric("loss", 6.0 - 0.1 * step, step=step)
            if step % 5 == 0:
                mlflow.log_metric("val_loss", 6.1 - 0.1 * step, step=step)
        tracking.log_evaluation(results)
        out = tracking.log_and_register_model(cfg, hf_dir, run_id, CHECKPOINT, manifest=MANIFEST, results=results)
    assert out and not tracking.DEGRADED, tracking.DEGRADED
    return {"run_id": run_id, "experiment_id": mlflow.get_run(run_id).info.experiment_id, **out}


def _child_fds(read_fd: int, write_fd: int) -> None:
    """In the browser's process: the DevTools pipe on fds 3 (commands in) and 4 (replies out)."""
    a, b = os.dup(read_fd), os.dup(write_fd)  # first out of the way: a pipe end may already sit on 3 or 4
    os.dup2(a, 3)
    os.dup2(b, 4)


class Browser:
    """Headless Chromium over the DevTools protocol (`--remote-debugging-pipe`: NUL-separated JSON messages),
    one tab. A command line cannot log in (a URL with credentials breaks the app's own fetches), the protocol
    can: `login` sends HTTP basic credentials with every request of the tab, as Playwright's httpCredentials."""

    def __init__(self, chromium: str, profile: Path):
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"]
        self.proc = subprocess.Popen(
            [chromium, *flags, "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1600,1400"]
            + ["--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=False,
            preexec_fn=lambda: _child_fds(cmd_r, out_w),
            start_new_session=True,
        )
        os.close(cmd_r)
        os.close(out_w)
        self._buf, self._id = b"", 0
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)

    def send(self, method: str, params: dict | None = None, timeout: float = 60) -> dict:
        """Run one command (in the tab once attached) and return its result; events in between are dropped."""
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if getattr(self, "session", None):
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply["result"]

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out_r], [], [], left)[0]:
                pytest.fail("chromium did not answer over the DevTools pipe")
            chunk = os.read(self._out_r, 1 << 20)
            assert chunk, f"chromium exited (code {self.proc.poll()})"
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def login(self, user: str, password: str) -> None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        self.send("Network.enable")
        self.send("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}})

    def render(self, url: str, out: Path, ready: tuple[str, ...], timeout: float = 90) -> tuple[str, str]:
        """(DOM, visible text) of `url` once every `ready` string is in the DOM (or at `timeout`: the caller's
        assertions then say what is missing); the DOM at out.html, a screenshot at out.png."""
        self.send("Page.navigate", {"url": url})
        deadline, dom = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            time.sleep(0.5)
            dom = self._evaluate("document.documentElement.outerHTML")
            if all(r in dom for r in ready):
                break
        out.with_suffix(".html").write_text(dom)
        shot = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        out.with_suffix(".png").write_bytes(base64.b64decode(shot))
        visible = re.sub(r"<(script|style|svg)\b.*?</\1>", " ", dom, flags=re.S)
        return dom, re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", visible)))

    def _evaluate(self, expression: str) -> str:
        return self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})["result"].get(
            "value", ""
        )


def _isolate_tracking_state(monkeypatch, password: str) -> None:
    """The pipeline's mlflow.set_tracking_uri sets $MLFLOW_TRACKING_URI (and HTTP settings): undone after the
    test; the client logs in as the admin through the environment, as the stack's clients do."""
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.setenv(key, "")  # records the original (unset) value for teardown ...
        monkeypatch.delenv(key)
    monkeypatch.setattr(uri_state, "_tracking_uri", uri_state._tracking_uri)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)


def _check_curves_view(browser: Browser, base: str, reg: dict, out: Path) -> None:
    """The link `difflm run` prints: the model-training view of the run, section "Training curves" first with
    one chart holding loss and val_loss (their legend entries), the one-value charts after it."""
    url = mlflow_curves_url(base, reg["experiment_id"], reg["run_id"])
    legend = [f"{RUN_NAME} ({m})" for m in ("loss", "val_loss")]
    dom, text = browser.render(url, out, ready=(*legend, "eval.trained.nll_per_token"))
    dom = html.unescape(dom)
    where = f"on {url} (DOM and screenshot: {out}.html/.png)"
    assert "Model metrics" in dom and "eval.trained.nll_per_token" in dom, f"no metrics {where}"
    order = [dom.find(s) for s in ("Training curves", *legend, "Model metrics", "eval.trained.nll_per_token")]
    assert -1 not in order and order == sorted(order), f"the curves are not first, on one chart {where}: {order}"
    assert re.search(r"Training curves\s*(<[^>]+>\s*)*\(1\)", dom), f"more than one chart before the rest {where}"
    # the model-training sidebar (Runs, Models, Model registry), not the GenAI one (Observability, Sessions, ...)
    assert "Model registry" in text and "Observability" not in text, f"not the model-training view {where}"


def _check_run_page(browser: Browser, base: str, reg: dict, out: Path) -> None:
    run_id, exp, name, version = reg["run_id"], reg["experiment_id"], reg["registered_model"], reg["version"]
    run_url = f"{base}/#/experiments/{exp}/runs/{run_id}"
    mv_link = f"#/models/{name}/versions/{version}"
    dom, text = browser.render(run_url, out, ready=("eval.trained.nll_per_token", MANIFEST.dir, mv_link))
    where = f"on {run_url} (DOM and screenshot: {out}.html/.png)"
    for metric in ("loss", "val_loss", "eval.trained.nll_per_token"):  # the training and evaluation metrics
        assert re.search(rf"(^|\s){re.escape(metric)}\s", text), f"metric {metric} not shown {where}"
    assert run_id in text and "model.hidden_size" in text, f"run id or config params not shown {where}"
    # the data it trained on: the dataset input (name, digest, context) and the data.hash tag
    assert re.search(rf"Datasets enwiki \({MANIFEST.hash}\) training", text, re.I), f"no dataset {where}"
    assert f"data.hash : {MANIFEST.hash}" in text, f"no data.hash tag {where}"
    # lineage: the run links to its registered version
    assert re.search(rf"Registered models {re.escape(name)} v{version}\b", text) and mv_link in dom, (
        f"no link to the registered version {where}"
    )


def _check_version_page(browser: Browser, base: str, reg: dict, out: Path) -> None:
    run_id, exp = reg["run_id"], reg["experiment_id"]
    run_url = f"{base}/#/experiments/{exp}/runs/{run_id}"
    mv_url = f"{base}/#/models/{reg['registered_model']}/versions/{reg['version']}"
    dom, text = browser.render(mv_url, out, ready=("candidate", "manifest.json", CHECKPOINT))
    where = f"on {mv_url} (DOM and screenshot: {out}.html/.png)"
    aliases = re.search(r"Aliases\s*:(.{0,120})", text)
    assert aliases and all(f"@ {a}" in aliases[1] for a in ("candidate", "champion")), f"no aliases {where}"
    assert f'href="#/experiments/{exp}/runs/{run_id}' in dom, f"no source run link {where}"
    # the description's lineage: the run (and its UI page), the data with its manifest, the checkpoint
    assert f"run: runs:/{run_id}" in text and f'href="{run_url}?workflowType=machine_learning"' in dom, (
        f"no run in the description {where}"
    )
    assert f"data: {MANIFEST.hash} from enwiki" in text, f"no data in the description {where}"
    assert f"dataset: runs:/{run_id}/data/manifest.json" in text, f"no manifest link {where}"
    assert f"checkpoint: {CHECKPOINT}" in text and "final val_loss 4.1000" in text, f"no checkpoint {where}"
    assert f"data.hash {MANIFEST.hash}" in text, f"no data.hash tag on the version {where}"


@pytest.mark.slow
def test_run_and_model_version_pages_show_metrics_aliases_and_lineage(tmp_path, monkeypatch, mlflow_server):
    """Logged in to an auth-enabled server (anonymous requests get 401): the printed curves link, the run page
    and the model version page."""
    chromium = _chromium()
    password = secrets.token_urlsafe(16)
    _isolate_tracking_state(monkeypatch, password)
    base, browser = mlflow_server(admin_password=password).url, None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", base)  # the server the credentials are for (difflm.credentials)
    try:
        for path in ("/", "/ajax-api/2.0/mlflow/experiments/search?max_results=1"):
            assert _anonymous_status(base + path) == 401, f"{path} open without credentials"
        cfg = load_config(
            "test-tiny",
            [f"workdir={tmp_path / 'work'}", f"tracking.tracking_uri={base}", "tracking.experiment=ui-browser"],
        )
        reg = _trained_and_registered(cfg, fake_export(tmp_path / "hf"))
        assert sorted(reg["aliases"]) == ["candidate", "champion"], reg
        browser = Browser(chromium, tmp_path / "chromium-profile")
        browser.login(ADMIN, password)
        _check_curves_view(browser, base, reg, tmp_path / "curves_view")
        _check_run_page(browser, base, reg, tmp_path / "run_page")
        _check_version_page(browser, base, reg, tmp_path / "version_page")
    finally:
        if browser:
            browser.close()
        shutil.rmtree(tmp_path / "chromium-profile", ignore_errors=True)  # 16 MB; the DOM dumps and screenshots stay
