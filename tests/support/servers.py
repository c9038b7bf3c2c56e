"""The server processes the tests start (a `prefect server`, an `mlflow server`, with or without its basic-auth
app): one way to start each on a free loopback port, wait until it answers, and stop it with its children. The
fixtures of conftest.py hand them to tests; `stop` is also for the other processes a test starts (`difflm serve`,
a Prefect worker)."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (all bound at once, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def stop(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds (a Prefect worker may ignore SIGTERM for a while)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Server:
    """A server process on 127.0.0.1:`port`, in its own session (its children go with it); `start` returns once
    `url` + `health` answers 200. It can be stopped and started again on the same port and state."""

    argv: list[str]
    env: dict[str, str]
    port: int
    health: str
    cwd: Path | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> Server:
        """Started and healthy within `timeout` (a fresh sqlite store is migrated first: slow on a loaded machine)."""
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[:4]} exited early with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.kill()
        raise TimeoutError(f"{self.argv[:4]} on port {self.port} not healthy within {timeout:.0f} s")

    def stop(self, grace: float = 20) -> None:
        """As an operator stops it: SIGTERM to its session, SIGKILL after `grace` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """As a crash ends it: SIGKILL to its whole session, at once."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def prefect_server(home: Path, **settings: str) -> Server:
    """`prefect server start` with its state under `home`; `env` is also what its clients (`prefect deploy`,
    `difflm serve`, a worker) need, PREFECT_API_URL included. `settings`: more PREFECT_* variables."""
    port = free_port()
    home.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        **settings,
    }
    argv = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    return Server(argv, env, port, "/api/health")


def mlflow_server(store: Path, admin_password: str | None = None) -> Server:
    """`mlflow server` on a sqlite store and a local artifact root in `store`, one worker, no job workers (~0.5 GB,
    not ~2.4). With `admin_password`, the basic-auth app started through deploy.mlflow_auth as the stack starts it
    (users in their own sqlite)."""
    store.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    argv = [sys.executable, "-m", "mlflow", "server"]
    if admin_password is not None:
        env |= {
            "MLFLOW_AUTH_DATABASE_URI": f"sqlite:///{store / 'auth.db'}",
            "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
            "PYTHONPATH": str(ROOT),
        }
        argv = [sys.executable, "-m", "deploy.mlflow_auth", "mlflow", "server", "--app-name", "basic-auth"]
    port = free_port()
    argv += ["--host", "127.0.0.1", "--port", str(port), "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}"]
    argv += ["--default-artifact-root", str(store / "artifacts"), "--workers", "1"]
    return Server(argv, env, port, "/health", cwd=ROOT)
