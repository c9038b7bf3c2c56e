"""The Docker test's cached images (tests/integration/test_docker_compose.py), built in the background from the
moment the test is collected: `python -m deploy.docker_local bases` (a Debian base, Python, PostgreSQL, the pipeline
image's dependency and runtime stages; about 6 minutes on a fresh host, seconds when cached). The build is mostly
downloads and layer writes, so it overlaps the tests that run before it; the test's `engine` fixture waits for it
(the daemon's data-root lock would make it wait anyway) and then builds only the project's own layers.

conftest.py calls `start` after collection (under xdist the controller calls `start_for`, once for the run) and `stop`
at the end of the session (a session that ends early stops the build, whose daemon stops with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deploy import docker_local

ROOT = Path(__file__).resolve().parents[2]
TEST_FILE = "test_docker_compose.py"

_build: subprocess.Popen | None = None
_log: Path | None = None
_started = 0.0


def start(items) -> None:
    """Start the build when the Docker test is among `items` and an engine can run here (else the test itself
    skips, or fails under CI, with the reason)."""
    start_for(item.nodeid for item in items)


def start_for(nodeids) -> None:
    """`start` from the test ids (xdist's controller has ids, not items: it starts the build for its workers, whose
    `wait` then finds none of their own; the engine's lock on the data root makes the test wait for it still)."""
    global _build, _log, _started
    if _build is not None or not any(Path(n.split("::", 1)[0]).name == TEST_FILE for n in nodeids):
        return
    if docker_local.unavailable():
        return
    fd, name = tempfile.mkstemp(prefix="difflm-docker-prebuild-", suffix=".log")
    _log, _started = Path(name), time.monotonic()
    with os.fdopen(fd, "w") as out:
        _build = subprocess.Popen(
            [sys.executable, "-m", "deploy.docker_local", "bases"],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C of the session reaches it through `stop`, once
        )


def wait(timeout: float = 1800) -> str | None:
    """Wait for the background build; its log, with how long the test waited for it (None: none was started).
    A failed build is not an error here: the fixture's own build then runs and says why it fails."""
    if _build is None or _log is None:
        return None
    t = time.monotonic()
    try:
        code = _build.wait(timeout)
    except subprocess.TimeoutExpired:
        stop()
        code = "timed out"
    text = _log.read_text(errors="replace").strip()
    return f"background image build (exit {code}, waited {time.monotonic() - t:.0f} s): {text[-1500:]}"


def stop() -> None:
    """Stop a build still running (SIGTERM: it stops its daemon), then remove its log."""
    global _build
    if _build is not None and _build.poll() is None:
        _build.send_signal(signal.SIGTERM)
        try:
            _build.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(_build.pid, signal.SIGKILL)
            _build.wait()
    _build = None
    if _log is not None:
        _log.unlink(missing_ok=True)
