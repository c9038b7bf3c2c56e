"""datatrove's local executor with a quiet terminal: per-task INFO (one "Reading input file" line per file, the
pipeline listing, each task's stats) goes to the task's log file only; the terminal keeps warnings and errors
(bad records, failures), datatrove's "N/M tasks completed" progress (several workers; one worker shows the
readers' progress bar) and the merged stats of the run, once.

datatrove calls `add_task_logger` at the start of every task (in the worker process), and that function
removes every loguru sink and adds stderr at INFO: a sink or filter set up before `executor.run()` is gone by
then. So the executor swaps in a quieter `add_task_logger` for the duration of each task."""

from __future__ import annotations

import sys

import datatrove.executor.base as base
from datatrove.executor import LocalPipelineExecutor
from datatrove.utils.logging import logger

TERMINAL_LEVEL = "WARNING"
# datatrove's own format (utils/logging.py), so task log files read as before
FORMAT = (
    "{time:YYYY-MM-DD HH:mm:ss.SSS} | <level>{level: <8}</level> | {name}:{function}:{line} - <level>{message}</level>"
)


def quiet_task_logger(logging_dir, rank: int, local_rank: int = 0, node_rank: int = -1):
    """datatrove's `add_task_logger` with the terminal at WARNING for every worker: everything still goes to the
    task's log file."""
    logger.remove()
    logfile = logging_dir.open(f"logs/task_{rank:05d}.log", "w")
    prefix = f"[NODE {node_rank}] " if node_rank != -1 else ""
    # every worker's warnings (datatrove shows only local rank 0's): the task that reports a bad record is rank 0,
    # which may run on any worker
    logger.add(sys.stderr, level=TERMINAL_LEVEL, format=prefix + FORMAT)
    logger.add(logfile, level="DEBUG", format=prefix + FORMAT, colorize=False)
    logger.info(f"Launching pipeline for {rank=}")
    return logfile


class QuietLocalExecutor(LocalPipelineExecutor):
    """`LocalPipelineExecutor` whose tasks log INFO to their files only (see the module)."""

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1):
        original = base.add_task_logger  # the name `_run_for_rank` looks up; restored after the task
        base.add_task_logger = quiet_task_logger
        try:
            return super()._run_for_rank(rank, local_rank, node_rank)
        finally:
            base.add_task_logger = original
