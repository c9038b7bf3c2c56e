"""The reaper (difflm.reaper) on real processes: what a command started in sessions of its own (which no group
kill reaches), and their children, die within a second or two of a SIGKILL of the command; a command that ends
normally keeps the say over what it started; what ran before the command is never touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

# a command under `reaped()`: a child in its own session that starts a grandchild in another, a child with the
# parent-death signal; it prints their pids, then waits to be killed (or, with `end`, ends normally)
COMMAND = textwrap.dedent(
    """
    import subprocess, sys, time
    from difflm.reaper import killed_with_parent, reaped
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the test reads the command's output to its end
    older = subprocess.Popen(sleeper, **quiet)  # started before the reaper: not the command's to clean up
    with reaped():
        spawner = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:], start_new_session=True); time.sleep(120)"
        a = subprocess.Popen([sys.executable, "-c", spawner, *sleeper], start_new_session=True, **quiet)
        b = subprocess.Popen(sleeper, start_new_session=True, preexec_fn=killed_with_parent(), **quiet)
        print(older.pid, a.pid, b.pid, flush=True)
        time.sleep(120 if sys.argv[1] == "wait" else 1.5)
    """
)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _start(mode: str) -> tuple[subprocess.Popen, list[psutil.Process], psutil.Process]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", COMMAND, mode], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    older, *started = (psutil.Process(int(pid)) for pid in proc.stdout.readline().split())
    time.sleep(1.2)  # the reaper samples the tree twice a second: the grandchild is seen
    family = [*started, *started[0].children()]
    assert len(family) == 3 and all(_alive(p) for p in family)
    return proc, family, older


@pytest.mark.integration
def test_a_killed_command_takes_what_it_started_with_it_but_nothing_older():
    proc, family, older = _start("wait")
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        end = time.monotonic() + 5
        while any(_alive(p) for p in family) and time.monotonic() < end:
            time.sleep(0.05)
        assert not [p.pid for p in family if _alive(p)]
        assert _alive(older)
        err = proc.stderr.read().decode()
        assert "ended without stopping what it started: killed" in err, err
    finally:
        for p in [*family, older]:
            if _alive(p):
                p.kill()


@pytest.mark.integration
def test_a_command_that_ends_normally_keeps_the_say_over_what_it_started():
    proc, family, older = _start("end")
    try:
        assert proc.wait(timeout=30) == 0
        time.sleep(1.5)
        assert all(_alive(p) for p in family if p.pid != family[1].pid)  # the reaper left them to the command
        assert proc.stderr.read() == b""
    finally:
        for p in [*family, older]:
            if _alive(p):
                p.kill()
