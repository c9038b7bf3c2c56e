"""What data prep raises for its user: a problem to fix, or a prep handed to a cluster (rerun later)."""

from __future__ import annotations

from difflm.errors import UserError


class DataPrepError(UserError, ValueError):
    """Data prep cannot run as configured (a missing or damaged input, a bad source); the message says why."""


class SubmittedToCluster(UserError, RuntimeError):
    """Raised after submitting to Slurm: rerun the same command once the job has finished."""

    exit_code = 75  # EX_TEMPFAIL: not done yet, rerun later (`difflm prep` itself reports it and exits 0)
