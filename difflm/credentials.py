"""Credentials in the environment, kept out of what a cluster stores.

Slurm keeps a job's environment (and its script) in its state directory (StateSaveLocation/hash.N/job.N/environment)
for as long as it holds the job, readable by its administrators and its backups. So a job submitted from here gets
this process's environment without its credentials, and the credentials through a file only this user reads
(a 0700 folder, the file 0600), which the job's shell reads at start. Training jobs (models/launch/slurm.py) and
data-prep jobs (data_prep/slurm.py) both do so.

MLflow sends $MLFLOW_TRACKING_USERNAME/PASSWORD (or $MLFLOW_TRACKING_TOKEN) to whatever server the tracking URI
names. They belong to the server of $MLFLOW_TRACKING_URI (as the stack's client.env and its worker set them both):
`check_tracking_uri` refuses a config's `tracking.tracking_uri` (a shared preset, a study spec, a deployment's
overrides) naming another server while they are set, before any request is made.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from difflm.errors import UserError

ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a name a shell can assign
CREDENTIAL = re.compile(
    r"(^|_)(PASSWORD|PASSWD|SECRET|SECRET_KEY|TOKEN|AUTH_STRING|API_KEY|ACCESS_KEY|PRIVATE_KEY)$"
    r"|DATABASE_(URL|URI)|CONNECTION_URL$",
    re.IGNORECASE,
)
CREDENTIAL_NAMES = "DIFFLM_CREDENTIAL_NAMES"  # in the file: which variables it set, for the job's log
TRACKING_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
LOCAL_STORES = {"", "file", "sqlite"}  # URI schemes MLflow opens itself: no request carries the credentials


class ForeignTrackingServer(UserError):
    """A config names an MLflow server other than the one this environment's tracking credentials are for."""


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


def _server(uri: str) -> tuple:
    """What makes two spellings of a tracking URI the same server: scheme, user, host, port and path."""
    parts = urlsplit(uri.strip())
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:  # not a port: only the same spelling is the same server
        return (uri,)
    return scheme, parts.username, parts.hostname, port, parts.path.rstrip("/")


def same_server(a: str, b: str) -> bool:
    return _server(a) == _server(b)


def check_tracking_uri(uri: str, home: str | None, env: Mapping[str, str] = os.environ) -> None:
    """Raise ForeignTrackingServer when `uri` (a config's tracking.tracking_uri) is a server other than `home`
    (the one the credentials are for: the user's $MLFLOW_TRACKING_URI, None when unset) while the environment
    holds MLflow tracking credentials, which MLflow would send there."""
    names = [k for k in TRACKING_CREDENTIALS if env.get(k)]
    if not names or urlsplit(uri.strip()).scheme.lower() in LOCAL_STORES:
        return
    if home and same_server(uri, home):
        return
    held = " and ".join(names)
    where = f"the server of MLFLOW_TRACKING_URI, {home}" if home else "MLFLOW_TRACKING_URI is not set"
    instead = f"; or remove tracking.tracking_uri from the config to track at {home}" if home else ""
    raise ForeignTrackingServer(
        f"tracking.tracking_uri {uri} is not the MLflow server that {held} of this environment belong to "
        f"({where}): MLflow would send them there, so nothing was sent. To track there, unset {held}, or set them "
        f"for that server together with MLFLOW_TRACKING_URI={uri}{instead}"
    )
