"""`pretrain-difflm` as a Prefect deployment: a real `prefect server` on 127.0.0.1, `difflm serve`,
and `prefect deployment run 'pretrain-difflm/...' --watch`, as the README tells users."""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:  # a Prefect worker may ignore SIGTERM for a while
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_deployment_run_from_the_cli(tmp_path):
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    (tmp_path / "prefect").mkdir()
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    serve = None
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/api/health", server)
        workdir = tmp_path / "work"
        serve = subprocess.Popen(
            [str(BIN / "difflm"), "serve", "--preset", "test-tiny", "--name", "ci", f"workdir={workdir}",
             "train.train_iters=6", "train.warmup_iters=1", "checkpoint.save_interval=6", "tracking.enabled=false"],
            env=env, stdout=(tmp_path / "serve.log").open("w"), stderr=subprocess.STDOUT,
        )
        deadline, out = time.time() + 60, None
        while time.time() < deadline:  # wait until `serve` has registered the deployment
            out = subprocess.run([str(BIN / "prefect"), "deployment", "ls"], env=env, capture_output=True, text=True)
            if "pretrain-difflm/ci" in out.stdout:
                break
            time.sleep(1)
        assert out is not None and "pretrain-difflm/ci" in out.stdout, out.stdout if out else None
        run = subprocess.run([str(BIN / "prefect"), "deployment", "run", "pretrain-difflm/ci", "--watch",
                              "--watch-timeout", "400"], env=env, capture_output=True, text=True, timeout=450)
        assert run.returncode == 0, run.stdout + run.stderr + (tmp_path / "serve.log").read_text()[-5000:]
        assert "Completed" in run.stdout
        exports = list(workdir.glob("runs/*/hf/model.safetensors"))
        assert len(exports) == 1
    finally:
        if serve:
            _stop(serve)
        _stop(server)
