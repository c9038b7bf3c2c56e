"""A watchdog that stops what a command started when the command dies without stopping it itself.

Why: a `difflm` command starts processes in sessions of their own (the temporary Prefect server, so that Ctrl-C
does not kill it before the flow has recorded the stop; torchrun, so that its checkpoint writers can be cleaned up
as a group). A `kill -9` of the command's process group, an OOM kill or a lost terminal cannot reach them, and they
ran on with parent 1 for good (issue 51). The parent-death signal alone is no cure: it reaches only the direct
child, fires when the parent's *thread* exits, and torchrun's ranks and their helpers are grandchildren.

`reaped()` starts `python -m difflm.reaper` in a session of its own (no group kill reaches it). It holds the read
end of a pipe whose write end only the command holds: the end of the block writes `done` (the command has stopped
its own processes: nothing to do); end-of-file without it, or the command's pid gone, means the command died.
Meanwhile it notes every process below the command twice a second (an orphan leaves the tree when its parent
dies, so it must be seen before); once the command is dead it freezes what it noted that still runs (SIGSTOP: a
torchrun cannot restart its ranks, nothing forks), adds their descendants, kills them all (SIGKILL), says so in one
line and exits. Processes below the command that are older than the reaper (an in-process caller's own servers)
are never touched, and a pid is only killed while its start time is the one noted (psutil), never a recycled one.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # resolved before any fork
DONE = b"done"
SAMPLE_S = 0.5  # how often the tree is sampled; a process that starts and loses its parent within it may be missed
STOP_WAIT_S = 5.0  # how long the reaper waits for the killed processes to go, for its one line


@contextmanager
def reaped() -> Iterator[None]:
    """Within: if this process dies (any signal, SIGKILL included), the processes it started meanwhile, and
    theirs, are killed within about a second. A normal end of the block (an exception included) leaves them to
    this process's own clean-up."""
    read_end, write_end = os.pipe()  # not inherited by what this process starts (PEP 446)
    me = psutil.Process()
    # what runs below this process already is not the command's (an in-process caller's servers): named by pid,
    # as start times (10 ms ticks) cannot tell a process started just before the reaper from one just after
    older = ",".join(str(p.pid) for p in me.children(recursive=True))
    try:
        watchdog = subprocess.Popen(
            [sys.executable, "-m", "difflm.reaper", str(me.pid), repr(me.create_time()), older],
            stdin=read_end,
            stdout=subprocess.DEVNULL,  # stderr stays the command's: the reaper's one line is for its user
            start_new_session=True,
        )
    finally:
        os.close(read_end)
    try:
        yield
    finally:
        try:
            os.write(write_end, DONE)
        except OSError:  # the reaper is gone already: nothing to tell it
            pass
        os.close(write_end)
        try:
            watchdog.wait(timeout=10)
        except subprocess.TimeoutExpired:  # never hold up the command's end for it
            pass


def watch(parent_pid: int, parent_started: float, older: set[int]) -> int:
    """The reaper's loop (`python -m difflm.reaper PID START OLDER`): returns once the parent has ended; the
    processes in `older` (pids) are never touched."""
    me = os.getpid()
    try:
        parent = psutil.Process(parent_pid)
        if abs(parent.create_time() - parent_started) > 0.01:  # not the process that started us
            return 0
    except psutil.NoSuchProcess:
        return 0
    seen: dict[int, psutil.Process] = {}
    while True:
        ready, _, _ = select.select([0], [], [], SAMPLE_S)
        if ready:
            said = os.read(0, 64)
            if said.startswith(DONE):
                return 0
            if not said:  # end of file without `done`: the parent died
                break
        try:
            for p in parent.children(recursive=True):
                if p.pid != me and p.pid not in older:
                    seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            break
        if not parent.is_running():
            break
    killed = stop_all(list(seen.values()))
    if killed:
        names = ", ".join(f"{pid} ({name})" for pid, name in killed[:6]) + (" ..." if len(killed) > 6 else "")
        print(
            f"difflm: the command (pid {parent_pid}) ended without stopping what it started: killed {len(killed)} "
            f"processes: {names}",
            file=sys.stderr,
            flush=True,
        )
    return 0


def stop_all(noted: list[psutil.Process]) -> list[tuple[int, str]]:
    """Freeze the noted processes that still run and every descendant they have, then kill them all; the pid
    and command of each killed."""
    frozen: dict[int, psutil.Process] = {}
    names: dict[int, str] = {}
    todo = [p for p in noted if _running(p)]
    while todo:  # frozen processes start nothing new, so this ends
        p = todo.pop()
        if p.pid in frozen or p.pid == os.getpid():
            continue
        try:
            p.suspend()
            frozen[p.pid], names[p.pid] = p, _name(p)
            todo.extend(p.children())
        except psutil.Error:  # gone meanwhile
            pass
    for p in frozen.values():
        try:
            p.kill()
        except psutil.Error:
            pass
    end = time.monotonic() + STOP_WAIT_S
    while any(_running(p) for p in frozen.values()) and time.monotonic() < end:
        time.sleep(0.05)
    return list(names.items())


def killed_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for a child that must not outlive this process however it dies: Linux's parent-death
    signal (SIGKILL), set in the child between fork and exec (it survives the exec). It fires when the *thread*
    that started the child ends, so start the child from a thread that outlives it (the one that stops it).
    None off Linux (the reaper still covers it)."""
    if _LIBC is None:
        return None
    prctl, parent = _LIBC.prctl, os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was set: it will never fire
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _running(p: psutil.Process) -> bool:
    try:  # is_running also compares the start time: a recycled pid is another process
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()[1:4])[:60] or p.name()
    except psutil.Error:
        return "?"


if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1]), float(sys.argv[2]), {int(pid) for pid in sys.argv[3].split(",") if pid}))
