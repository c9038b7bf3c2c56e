"""Ending the MLflow runs of a command that died (kill -9, out of memory) while they were RUNNING: the next
command on the workdir finds its record (difflm.live_runs) and marks them FAILED, saying why in a tag."""

from __future__ import annotations

import os

FAILURE_TAG = "difflm.failure"  # why the run was marked failed by another command


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
