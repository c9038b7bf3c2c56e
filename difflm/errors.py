"""One exception hierarchy for the whole pipeline (the ground floor: imports nothing of the project).

Callers decide by type, never by matching message text:
- `UserError`: the message already says what to do; the CLI prints it without a traceback (exit code 1, or
  the class's `exit_code`).
- `retryable`: whether running the same stage again can help (a preemption, a crashed trainer); the Prefect
  train task retries exactly these.
"""

from __future__ import annotations

import errno


class DiffLMError(Exception):
    """Base of every error the pipeline raises on purpose."""

    exit_code: int = 1
    retryable: bool = False


class UserError(DiffLMError):
    """Bad input or a state the user can fix: the message names the input and what to do."""


class ConfigWarning(UserWarning):
    """A setting that works but is likely not what was meant; the message says what to set instead. The CLI
    prints it as one `warning:` line (not Python's file:line and source line of wherever it was raised)."""


class DiskFull(UserError):
    """No space left on a device (or the quota spent) while writing a stage's output: rerunning after freeing
    space resumes (finished stages are reused, training resumes from its latest checkpoint)."""


def is_disk_full(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full(where, doing: str, resume: str = "finished stages are reused") -> DiskFull:
    """The one line for a full disk under `where` while `doing`: what to free, and that a rerun resumes."""
    return DiskFull(
        f"no space left on the device of {where} while {doing}: free space there (old runs under "
        f"<workdir>/runs and their exports, unused prepared data under <workdir>/data, fewer checkpoints with "
        f"checkpoint.keep_last; `df -h {where}` shows what is left) and rerun the same command: {resume}"
    )


class TrainingError(UserError, RuntimeError):
    """Training failed or could not start; a crashed or killed trainer resumes from its checkpoint on a rerun."""

    retryable = True


class TrainingPreempted(TrainingError):
    """The trainer got a preemption signal, saved a checkpoint and exited: run it again to resume."""

    exit_code = 75  # EX_TEMPFAIL: schedulers and wrappers rerun on it

    def __init__(self, message: str, iteration: int):
        super().__init__(message)
        self.iteration = iteration


class Interrupted(TrainingPreempted):
    """Ctrl-C: the trainer saved a checkpoint and stopped. Exit 75 as for a preemption, but never retried by
    the flow (the user asked it to stop); rerunning the same command resumes."""

    retryable = False


class NonFiniteStop(TrainingError):
    """Training stopped on non-finite loss or gradients: the same data would fail the same way."""

    retryable = False


class InvalidSetup(TrainingError):
    """A launch that can never work as asked (e.g. multi-node without a cluster launcher)."""

    retryable = False
