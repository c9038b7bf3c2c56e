"""Credentials in the environment, kept out of what a cluster stores.

Slurm keeps a job's environment (and its script) in its state directory (StateSaveLocation/hash.N/job.N/environment)
for as long as it holds the job, readable by its administrators and its backups. So a job submitted from here gets
an allow-list of this process's environment (`job_environment`: PATH, HOME, locale, the offline settings, the Python
environment, CUDA/NCCL/OMP/torch settings, SLURM_*, DIFFLM_*, ...; no secret is stored under a name no deny-list
knows, such as PGPASSWORD), and the credentials it may need (names `is_credential` matches, and an allowed
variable holding a URL's user:password@, such as HTTPS_PROXY) through a file only this user reads (a 0700 folder,
the file 0600), which the job's shell reads at start. Training jobs (models/launch/slurm.py) and data-prep jobs
(data_prep/slurm.py) both do so.

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

from difflm import OFFLINE_ENV
from difflm.errors import UserError

ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a name a shell can assign
CREDENTIAL = re.compile(
    r"(^|_)(PASSWORD|PASSWD|SECRET|SECRET_KEY|TOKEN|AUTH_STRING|API_KEY|ACCESS_KEY|PRIVATE_KEY)$"
    r"|DATABASE_(URL|URI)|CONNECTION_(URL|STRING)$|(^|_)ACCESS_KEY_ID$",
    re.IGNORECASE,
)
URL_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s@]+@")  # scheme://user[:password]@host
# What a job needs of the submitter's environment; nothing else is passed (Slurm stores what it is given).
JOB_ENV = {
    *OFFLINE_ENV,
    *("PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TZ", "TMPDIR", "LANG", "LANGUAGE"),
    *("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONHASHSEED", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV"),
    *("LD_LIBRARY_PATH", "XDG_CACHE_HOME", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"),
    *("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY"),  # either case; one with user:password@ goes to the file
}
JOB_ENV_PREFIXES = (
    *("LC_", "SLURM_", "DIFFLM_", "CUDA_", "NCCL_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GLOO_", "NVIDIA_"),
    *("TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "TRITON_", "HF_", "TRANSFORMERS_", "MLFLOW_", "AWS_"),
)
CREDENTIAL_NAMES = "DIFFLM_CREDENTIAL_NAMES"  # in the file: which variables it set, for the job's log
TRACKING_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
LOCAL_STORES = {"", "file", "sqlite"}  # URI schemes MLflow opens itself: no request carries the credentials


class ForeignTrackingServer(UserError):
    """A config names an MLflow server other than the one this environment's tracking credentials are for."""


def is_credential(name: str) -> bool:
    """Whether an environment variable holds a credential (a password, token, auth string, key, database URL)."""
    return bool(CREDENTIAL.search(name))


def is_secret(name: str, value: str) -> bool:
    """A credential by its name, or a value carrying a URL's user:password@ (a proxy's, a package index's)."""
    return is_credential(name) or bool(URL_USERINFO.search(value))


def is_job_variable(name: str) -> bool:
    """Whether a job is given this variable of the submitter's environment (JOB_ENV, JOB_ENV_PREFIXES)."""
    spelt = name.upper() if name.upper().endswith("_PROXY") else name  # https_proxy as HTTPS_PROXY
    return spelt in JOB_ENV or name.startswith(JOB_ENV_PREFIXES)


def job_environment(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(what a job's stored environment gets of `env`: its allowed variables without secrets; the secrets the job
    reads from the credentials file: every credential, and the allowed variables with user:password@ in a URL).
    The rest (PGPASSWORD, PIP_INDEX_URL, anything not on the list) stays here."""
    kept = {k: v for k, v in env.items() if is_job_variable(k) and not is_secret(k, v)}
    return kept, {k: v for k, v in env.items() if is_credential(k) or is_job_variable(k) and is_secret(k, v)}


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
