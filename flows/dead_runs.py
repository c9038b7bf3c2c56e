"""The next command on a workdir ends what a dead one left RUNNING: its MLflow runs and its Prefect flow run.

A command that was killed (`kill -9` of its process group, out of memory, a lost node) never ended its runs: the
MLflow UI and the Prefect UI showed them RUNNING for ever (issue 51). Each command that runs flows keeps a locked
record of what it started (difflm.live_runs); the next one, once its Prefect API is up, marks the runs of every
record whose command is gone as failed, with the reason, and says so in one line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from difflm import live_runs
from difflm.flows.prefect_api import fail_flow_runs
from difflm.tracking.dead_runs import fail_mlflow_runs


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def mark_dead_runs(workdir: str | Path, echo: Callable[[str], object] = _stderr) -> None:
    """Mark the runs of every dead command recorded in `workdir` failed (within a Prefect API: `prefect_api`).
    What cannot be marked now (a tracking server that is down) is kept for the next command, with one line."""
    with live_runs.dead_records(workdir) as dead:
        for path, record in dead:
            reason = (
                f"{record.who()} ended before this run did (killed: kill -9, out of memory, a lost node?); "
                f"marked failed by the next command on {workdir}"
            )
            try:
                mlflow_runs = fail_mlflow_runs(record.mlflow_runs, reason) if record.mlflow_runs else []
                flow_runs = fail_flow_runs(record.flow_runs, reason) if record.flow_runs else []
            except Exception as err:  # a store or server that is away: the next command tries again
                echo(
                    f"difflm: warning: could not mark the runs of {record.who()} failed "
                    f"({type(err).__name__}: {err}); the next command tries again"
                )
                continue
            path.unlink(missing_ok=True)
            if mlflow_runs or flow_runs:
                echo(
                    f"difflm: {record.who()} died without ending its runs: marked them failed "
                    f"(MLflow runs: {', '.join(mlflow_runs) or 'none'}; Prefect flow runs: "
                    f"{', '.join(flow_runs) or 'none'})"
                )
