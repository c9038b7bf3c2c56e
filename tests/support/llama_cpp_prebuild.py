"""llama.cpp's diffusion CLI for the tests that run it (tests/integration/test_llama_cpp.py), built in the background
from the moment such a test is collected: `python -m deploy.llama_cpp build` (download 12 s, then about 4 min of
compiling on 2 idle cores at nice 10, 9.5 CPU-minutes measured; seconds when cached in
~/.cache/difflm/llama.cpp/<version>).
The tests before it run meanwhile; the `llama_cpp` fixture waits for it.

conftest.py calls `start` after collection (under xdist the controller calls `start_for`, once for the run; the
build's lock makes a worker's own build wait for it and then find the binary) and `stop` at the end of the session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deploy import llama_cpp

ROOT = Path(__file__).resolve().parents[2]
MARK = "llama_cpp"  # in the name of every test file that runs llama.cpp

_build: subprocess.Popen | None = None
_log: Path | None = None


def start(items) -> None:
    start_for(item.nodeid for item in items)


def start_for(nodeids) -> None:
    """Start the build when a llama.cpp test is among the test ids and the binary is not cached yet."""
    global _build, _log
    if _build is not None or not any(MARK in Path(n.split("::", 1)[0]).name for n in nodeids):
        return
    if llama_cpp.built() or llama_cpp.unavailable():
        return  # cached; or the test says why it cannot be built
    fd, name = tempfile.mkstemp(prefix="difflm-llama-cpp-prebuild-", suffix=".log")
    _log = Path(name)
    with os.fdopen(fd, "w") as out:
        _build = subprocess.Popen(
            [sys.executable, "-m", "deploy.llama_cpp", "build"],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait(timeout: float = 1800) -> str | None:
    """Wait for the background build; its log's tail and how long the test waited (None: none was started here)."""
    if _build is None or _log is None:
        return None
    t = time.monotonic()
    try:
        code = _build.wait(timeout)
    except subprocess.TimeoutExpired:
        stop()
        code = "timed out"
    text = _log.read_text(errors="replace").strip() if _log.exists() else ""
    return f"background llama.cpp build (exit {code}, waited {time.monotonic() - t:.0f} s): {text[-1500:]}"


def stop() -> None:
    """Stop a build still running (its process group: cmake and the compilers), then remove its log."""
    global _build
    if _build is not None and _build.poll() is None:
        os.killpg(_build.pid, signal.SIGTERM)
        try:
            _build.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(_build.pid, signal.SIGKILL)
            _build.wait()
    _build = None
    if _log is not None:
        _log.unlink(missing_ok=True)
