"""Ctrl-C during `difflm run` or `difflm study` ends in one line of ours (`difflm: interrupted at iteration N ...`):
the console keeps none of Prefect's ERROR records that repeat it, and every other record (the Prefect API's handler,
which the filter does not touch, keeps these too)."""

import asyncio
import logging

from prefect.states import exception_to_failed_state

from difflm.errors import Interrupted
from difflm.flows.prefect_api import _InterruptOnce

INTERRUPTED = Interrupted("interrupted at iteration 44 (SIGINT); checkpoint saved: /w/ckpt; rerun the same command", 44)


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []
        self.addFilter(_InterruptOnce())

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_prefects_repeats_of_an_interrupt_stay_off_the_console():
    kept = _Kept()
    task, flow = logging.getLogger("prefect.task_runs"), logging.getLogger("prefect.flow_runs")
    levels = [(logger, logger.level) for logger in (task, flow)]
    for logger in (task, flow):
        logger.addHandler(kept)
        logger.setLevel(logging.INFO)
    try:
        # what Prefect's engines log when the train task raises Interrupted (task_engine / flow_engine), the states
        # made by Prefect's own function
        task_state = asyncio.run(exception_to_failed_state(INTERRUPTED, message="Task run encountered an exception"))
        flow_state = asyncio.run(exception_to_failed_state(INTERRUPTED, message="Flow run encountered an exception"))
        task.error(f"Finished in state {task_state}")
        try:
            raise INTERRUPTED
        except Interrupted as exc:
            flow.exception("Encountered exception during execution: %r", exc)
        flow.error(f"Finished in state {flow_state}")
        flow.error("Crash detected! Execution was aborted by an interrupt signal.")
        # what stays: progress, other failures
        task.info("Finished in state Completed()")
        task.error("Finished in state Failed('Task run encountered an exception DataPrepError: bad input')")
    finally:
        for logger, level in levels:
            logger.removeHandler(kept)
            logger.setLevel(level)
    assert "Interrupted: interrupted at iteration 44" in str(task_state)  # the form the filter recognises
    assert kept.lines == [
        "Finished in state Completed()",
        "Finished in state Failed('Task run encountered an exception DataPrepError: bad input')",
    ]
