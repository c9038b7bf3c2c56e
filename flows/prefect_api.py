"""The Prefect API a CLI command talks to: the configured one (PREFECT_API_URL), else a temporary local server
that this process starts in its own session; and marking the flow runs of a dead command failed.

Why not Prefect's own temporary server: it is a child in the terminal's process group, so Ctrl-C stops it at
once while the flow still has states to report; the flow then retried a dead API for minutes and printed
tracebacks (tried as a new user would). In its own session the server outlives the interrupt long enough for
the flow to record where training stopped, and is stopped when the command ends. A group kill (`kill -9 -- -PGID`)
cannot reach it there, so it also gets the parent-death signal: it dies with the command however that dies (it
ran on with parent 1 for good before; issue 51). Its database stays in PREFECT_HOME (the workdir's .prefect/), so
the next command's server reads the flow runs a killed command left RUNNING, and `fail_flow_runs` ends them.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import types
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from difflm.errors import Interrupted, UserError
from difflm.locks import exclusive
from difflm.reaper import killed_with_parent
from difflm.rundir import lock_file

# Prefect is imported inside the functions: the CLI loads this module for every command (`--help` included),
# and Prefect reads its settings when imported, which must come after the CLI has pointed PREFECT_HOME at the workdir
# Prefect waits 20 s by default; a busy machine (a suite, a data prep) needs longer to start a server. The user's
# own value of Prefect's setting wins.
START_TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
SERVER_START_TIMEOUT_S = 180


class _NoTracebackForUserErrors(logging.Filter):
    """On the console, a UserError from a task or flow is its message: it already says what to do. (The
    Prefect API still gets the full record.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], UserError):
            record.exc_info, record.exc_text = None, None
        return True


class _InterruptOnce(logging.Filter):
    """On the console, Ctrl-C (or SIGTERM) is the command's one last line (`difflm: interrupted at iteration N
    ...`): Prefect's ERROR records that repeat it (the task's and the flow's `Finished in state Failed(... Interrupted:
    ...)`, `Encountered exception during execution: Interrupted(...)`, a study's `Crash detected! Execution was
    aborted by an interrupt signal.`) are left out there. The Prefect API still gets them: the UI shows how the run
    ended."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.name.startswith("prefect"):
            return True
        if record.exc_info and isinstance(record.exc_info[1], (Interrupted, KeyboardInterrupt)):
            return False
        text = record.getMessage()
        repeated = ("Interrupted: ", "Interrupted(", "aborted by an interrupt signal")
        return not any(r in text for r in repeated)


@contextmanager
def prefect_api(needed: bool) -> Iterator[None]:
    """Within: a reachable Prefect API when `needed` (a flow will run), and tracebacks of user errors kept off
    the console; nothing changes otherwise."""
    if not needed:
        yield
        return
    import prefect.main  # noqa: F401 - configures logging, whose console handler gets the filter

    filters = (_NoTracebackForUserErrors(), _InterruptOnce())
    for handler in logging.getLogger().handlers:
        for quiet in filters:
            handler.addFilter(quiet)
    try:
        with _temporary_server_unless_configured():
            yield
    finally:
        for handler in logging.getLogger().handlers:
            for quiet in filters:
                handler.removeFilter(quiet)


@contextmanager
def _temporary_server_unless_configured() -> Iterator[None]:
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    if PREFECT_API_URL.value():  # the environment, a profile, or a test harness's temporary settings
        yield
        return
    from prefect.logging.handlers import APILogHandler
    from prefect.server.api import server as prefect_server

    class OwnSessionServer(prefect_server.SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            # Prefect builds the server's command line and environment; only the session and the parent-death
            # signal are ours (started from this thread, which also stops it: the signal fires when it ends)
            own_session = types.SimpleNamespace(
                Popen=functools.partial(subprocess.Popen, start_new_session=True, preexec_fn=killed_with_parent())
            )
            prefect_server.subprocess, saved = own_session, prefect_server.subprocess
            try:
                return super()._run_uvicorn_command()
            finally:
                prefect_server.subprocess = saved

    server = OwnSessionServer()
    # one server at a time creates and migrates the database in PREFECT_HOME: two at once raced ('index ...
    # already exists'); the second starts once the first is up, on the migrated database
    database = get_current_settings().home / "prefect.db"
    with exclusive(lock_file(database), f"the Prefect database {database}", "wait", print):
        _start(server)
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            try:
                yield
            finally:  # the flow's last log lines reach the server before it stops
                for handler in logging.getLogger("prefect.flow_runs").handlers:
                    if isinstance(handler, APILogHandler):
                        handler.flush()
    finally:
        server.stop()


def start_timeout_s() -> int:
    """How long to wait for the temporary server: the setting when the user set it, else SERVER_START_TIMEOUT_S."""
    given = os.environ.get(START_TIMEOUT_SETTING, "").strip()
    if not given:
        return SERVER_START_TIMEOUT_S
    if not given.isdigit() or int(given) < 1:
        raise UserError(f"{START_TIMEOUT_SETTING}={given!r} is not a whole number of seconds >= 1")
    return int(given)


def _start(server) -> None:
    """Start the temporary server, or say in one line which setting gives it longer."""
    timeout = start_timeout_s()
    try:
        server.start(timeout=timeout)
    except RuntimeError as err:
        server.stop()  # a server that answered too late is not left running
        if "Timed out" not in str(err):
            raise
        raise UserError(
            f"the temporary Prefect server did not answer within {timeout} s (a busy machine?): give it longer "
            f"with {START_TIMEOUT_SETTING}=<seconds>, or point PREFECT_API_URL at a running server"
        ) from None


def fail_flow_runs(flow_run_ids: list[str], reason: str) -> list[str]:
    """Set those of the flow runs (and their task runs) that are not finished to Failed with `reason`, on the
    current Prefect API; the ids set. A flow run that API does not know (a dead command that used another
    server) is left alone."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Failed

    marked = []
    with get_client(sync_client=True) as client:
        for flow_run_id in flow_run_ids:
            try:
                flow_run = client.read_flow_run(uuid.UUID(flow_run_id))
            except (ObjectNotFound, ValueError):
                continue
            if flow_run.state is not None and flow_run.state.is_final():
                continue
            in_flow_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
            for task_run in client.read_task_runs(flow_run_filter=in_flow_run):
                if task_run.state is None or not task_run.state.is_final():
                    client.set_task_run_state(task_run.id, Failed(message=reason), force=True)
            client.set_flow_run_state(flow_run.id, Failed(message=reason), force=True)
            marked.append(flow_run_id)
    return marked
