"""Credentials in the environment, kept out of what a cluster stores.

Slurm keeps a job's environment (and its script) in its state directory (StateSaveLocation/hash.N/job.N/environment)
for as long as it holds the job, readable by its administrators and its backups. So a job submitted from here gets
this process's environment without its credentials, and the credentials through a file only this user reads
(a 0700 folder, the file 0600), which the job's shell reads at start. Training jobs (models/launch/slurm.py) and
data-prep jobs (data_prep/slurm.py) both do so.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path

ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a name a shell can assign
CREDENTIAL = re.compile(
    r"(^|_)(PASSWORD|PASSWD|SECRET|SECRET_KEY|TOKEN|AUTH_STRING|API_KEY|ACCESS_KEY|PRIVATE_KEY)$"
    r"|DATABASE_(URL|URI)|CONNECTION_URL$",
    re.IGNORECASE,
)
CREDENTIAL_NAMES = "DIFFLM_CREDENTIAL_NAMES"  # in the file: which variables it set, for the job's log


def is_credential(name: str) -> bool:
    """Whether an environment variable holds a credential (a password, token, auth string, key, database URL)."""
    return bool(CREDENTIAL.search(name))


def split_credentials(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(`env` without its credentials, its credentials)."""
    clean = {k: v for k, v in env.items() if not is_credential(k)}
    return clean, {k: v for k, v in env.items() if is_credential(k)}


def write_credentials_file(path: Path, secret: Mapping[str, str]) -> bool:
    """Write `secret` to `path` as shell assignments (its folder made 0700 and the file 0600 before it holds
    anything); whether there was anything to write (nothing: no file, an older one removed)."""
    if not secret:
        path.unlink(missing_ok=True)
        return False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file of another mode
    names = sorted(k for k in secret if ENV_KEY.fullmatch(k))
    with os.fdopen(fd, "w") as fh:
        fh.writelines(f"{k}={shlex.quote(secret[k])}\n" for k in names)
        fh.write(f"{CREDENTIAL_NAMES}={shlex.quote(' '.join(names))}\n")
    return True


def read_credentials(var: str) -> str:
    """The shell commands a job runs to read the credentials file named by `$var` into its environment
    (exported), logging which variables it set, never their values."""
    return (
        f'set -a; . "${var}" || exit 1; set +a; echo "difflm: credentials read from ${var}: ${{{CREDENTIAL_NAMES}:-}}"'
    )
