"""What tracking could not do, and a tracking call that never fails the pipeline (`tolerant`): each failure is
said once, kept for the process (`DEGRADED`) and for the current execution (`degradations`), whose summary line
reports it (`summary_line`). Patch `DEGRADED` here, where `degrade` reads it."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

DEGRADED: list[str] = []  # what tracking could not do in this process, every execution's
# ...and in the current execution only (`degradations`): a study's points run in threads of one process, each in
# its own context, and one point's summary must not report another's failures
_EXECUTION: ContextVar[list[str] | None] = ContextVar("difflm_tracking_degraded", default=None)


@contextmanager
def degradations() -> Iterator[list[str]]:
    """Within: what tracking could not do goes to the list yielded (too), which the flow reports as its
    `tracking` summary. A thread or task started inside sees the same list (contexts are copied)."""
    notes: list[str] = []
    token = _EXECUTION.set(notes)
    try:
        yield notes
    finally:
        _EXECUTION.reset(token)


def degrade(what: str, err: BaseException) -> None:
    """Tracking failed: say so once per kind of failure and execution, remember it, go on."""
    note = f"{what} ({type(err).__name__}: {str(err)[:200]})"
    execution = _EXECUTION.get()
    seen = DEGRADED if execution is None else execution
    if not any(d.startswith(what) for d in seen):
        print(f"tracking degraded: {note}; the pipeline goes on (metrics stay in the run directory)", flush=True)
    DEGRADED.append(note)
    if execution is not None:
        execution.append(note)


def summary_line(notes: list[str]) -> str:
    """The `tracking` field of a flow's summary."""
    return "degraded: " + "; ".join(notes) if notes else "ok"


def tolerant(fn):
    """A tracking call that never fails the pipeline: errors are reported by `degrade` and return None."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            degrade(f"{fn.__name__} failed", err)
            return None

    return wrapper
