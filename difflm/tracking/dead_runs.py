"""The runs of a command that dies (kill -9, out of memory) while they are RUNNING: each command notes the MLflow
runs and the Prefect flow run it starts in its record (difflm.live_runs); the next command on the workdir finds
the record of a dead one and marks its MLflow runs FAILED, saying why in a tag (its flow runs: flows/dead_runs.py)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

from difflm import live_runs
from difflm.live_runs import note_mlflow_run

__all__ = ["FAILURE_TAG", "fail_mlflow_runs", "note_flow_run", "note_mlflow_run", "without_userinfo"]

FAILURE_TAG = "difflm.failure"  # why the run was marked failed by another command


def note_flow_run() -> None:
    """Record the Prefect flow run this thread runs in (if any) as this command's: should the command die, the
    next one marks it failed (difflm.live_runs)."""
    try:
        from prefect.runtime import flow_run  # prefect (seconds to import) stays out of difflm's own import

        if flow_run.id:
            live_runs.note_flow_run(str(flow_run.id))
    except ImportError:  # no Prefect: no flow run
        pass


def without_userinfo(uri: str) -> str:
    """`uri` without a `user:password@` part: a record on disk holds no credential (MLflow reads them from the
    environment)."""
    parts = urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def fail_mlflow_runs(runs: dict[str, str], reason: str) -> list[str]:
    """Mark those of `runs` (run id -> tracking URI) that are still RUNNING as FAILED, `reason` in FAILURE_TAG;
    the ids marked. A run the store no longer has is left alone."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    for key, val in {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}.items():
        os.environ.setdefault(key, val)  # a server that is down costs seconds, not MLflow's default minutes
    clients: dict[str, MlflowClient] = {}
    marked = []
    for run_id, uri in runs.items():
        client = clients.setdefault(uri, MlflowClient(uri))
        try:
            status = client.get_run(run_id).info.status
        except MlflowException as err:
            if err.error_code == "RESOURCE_DOES_NOT_EXIST":  # deleted meanwhile: nothing to mark
                continue
            raise
        if status != "RUNNING":
            continue
        client.set_tag(run_id, FAILURE_TAG, reason)
        client.set_terminated(run_id, "FAILED")
        marked.append(run_id)
    return marked
