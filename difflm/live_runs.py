"""Which commands are running on a workdir, and which died without closing their MLflow runs and Prefect flow runs.

A command that runs flows holds a record in `<workdir>/.live/`: a JSON file (its pid, host, start and the MLflow
runs and Prefect flow runs it started) locked with `flock` for as long as the process lives. The lock ends with the
process however it ends (kill -9, OOM, a lost node on a filesystem that locks across nodes: see difflm.locks), so
the next command can tell a dead command's record from a live one's without guessing from pids, and on any host:
a record it can lock belongs to a command that is gone. A command that ends normally removes its record; one that
was killed leaves it, and its runs still RUNNING, for the next command to mark failed (flows/cli.py) and remove.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from difflm.locks import open_lock_file  # its refusals of planted links and foreign files hold here too

LIVE = ".live"  # in a workdir


@dataclass
class Record:
    """One command's record: who it is, and what it started that a killed command would leave RUNNING."""

    pid: int
    host: str
    since: float
    command: str
    mlflow_runs: dict[str, str] = field(default_factory=dict)  # run id -> tracking URI
    flow_runs: list[str] = field(default_factory=list)  # Prefect flow run ids

    def who(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"`difflm {self.command}` (pid {self.pid} on {self.host}, started {when})"


class _Held:
    """This process's record, open and locked; every note rewrites it."""

    def __init__(self, path: Path, record: Record):
        self.path, self.record, self.lock = path, record, threading.Lock()
        self.fd = open_lock_file(path)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new name: nobody else holds it
        self._write()

    def _write(self) -> None:
        data = json.dumps(self.record.__dict__).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def note(self, mlflow_run: tuple[str, str] | None = None, flow_run: str | None = None) -> None:
        with self.lock:
            new = bool(mlflow_run and mlflow_run[0] not in self.record.mlflow_runs)
            new |= bool(flow_run and flow_run not in self.record.flow_runs)
            if mlflow_run:
                self.record.mlflow_runs.setdefault(*mlflow_run)
            if flow_run and flow_run not in self.record.flow_runs:
                self.record.flow_runs.append(flow_run)
            if new:
                self._write()


_ACTIVE: list[_Held] = []  # this process's records (one per command running in it)


@contextmanager
def recorded(workdir: str | Path, command: str) -> Iterator[None]:
    """Within: this command's record in `workdir`, locked; removed at the end (kept only when the process dies)."""
    folder = Path(workdir) / LIVE
    folder.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    path = folder / f"{host}-{os.getpid()}-{secrets.token_hex(3)}.json"
    held = _Held(path, Record(os.getpid(), host, time.time(), command))
    _ACTIVE.append(held)
    try:
        yield
    finally:
        _ACTIVE.remove(held)
        path.unlink(missing_ok=True)  # while still locked: no other command reads it as a dead one's
        os.close(held.fd)


def note_mlflow_run(run_id: str, tracking_uri: str) -> None:
    """Record that this command started MLflow run `run_id` (nothing outside a recorded command)."""
    if _ACTIVE:
        _ACTIVE[-1].note(mlflow_run=(run_id, tracking_uri))


def note_flow_run(flow_run_id: str) -> None:
    """Record that this command runs Prefect flow run `flow_run_id` (nothing outside a recorded command)."""
    if _ACTIVE:
        _ACTIVE[-1].note(flow_run=flow_run_id)


@contextmanager
def dead_records(workdir: str | Path) -> Iterator[list[tuple[Path, Record]]]:
    """Within: the records in `workdir` whose command is gone (their locks, held by this process meanwhile, so that
    two commands do not handle one twice). The caller removes each record it has handled (`path.unlink()`); one it
    leaves is handled again by a later command."""
    folder = Path(workdir) / LIVE
    held: list[int] = []
    dead: list[tuple[Path, Record]] = []
    try:
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                fd = open_lock_file(path)
            except FileNotFoundError:  # its command ended meanwhile
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its command is alive
                os.close(fd)
                continue
            held.append(fd)
            if not os.path.exists(path):  # removed by its command (or another sweep) before we locked it
                continue
            try:
                dead.append((path, Record(**json.loads(os.pread(fd, 1 << 20, 0)))))
            except (ValueError, TypeError):  # killed before it wrote its record: nothing to mark
                path.unlink(missing_ok=True)
        yield dead
    finally:
        for fd in held:
            os.close(fd)
