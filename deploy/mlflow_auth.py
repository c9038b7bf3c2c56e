"""Start `mlflow server --app-name basic-auth` with its user store on PostgreSQL, no secret on the command line.

MLflow's auth app reads its database URI from an ini file only (MLFLOW_AUTH_CONFIG_PATH): this writes that file,
mode 0600 in a private folder (DIFFLM_MLFLOW_AUTH_DIR, which the native start sets to <state>/mlflow-auth so
that `stack down` removes it; else a new temporary folder, inside the container under docker compose), from the environment (MLFLOW_AUTH_DATABASE_URI; the admin password comes from
MLFLOW_AUTH_ADMIN_PASSWORD, which MLflow reads itself), then replaces itself with the command given:

    python -m deploy.mlflow_auth mlflow server --app-name basic-auth ...

The same command runs in docker-compose.yml and in the native start (deploy/stack.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

DIR_VAR = "DIFFLM_MLFLOW_AUTH_DIR"  # where to write the ini (default: a new private temporary folder)
INI = "basic_auth.ini"


def write_config(database_uri: str, folder: Path | None = None, default_permission: str = "READ") -> Path:
    """The auth app's ini file (mode 0600) in `folder` (default: a new private temporary folder)."""
    folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="mlflow-auth-"))
    path = folder / INI
    text = (
        "[mlflow]\n"
        f"default_permission = {default_permission}\n"
        f"database_uri = {database_uri.replace('%', '%%')}\n"
        "admin_username = admin\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)  # never through a link
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)
    return path


def main(argv: list[str]) -> None:
    uri = os.environ.get("MLFLOW_AUTH_DATABASE_URI")
    if not uri or not argv:
        sys.exit("usage: MLFLOW_AUTH_DATABASE_URI=... python -m deploy.mlflow_auth mlflow server --app-name basic-auth")
    for key in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        if not os.environ.get(key):
            sys.exit(f"{key} is not set: the stack generates it into its env file (python -m deploy.stack secrets)")
    folder = os.environ.pop(DIR_VAR, None)
    if folder:
        Path(folder).mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
    os.environ["MLFLOW_AUTH_CONFIG_PATH"] = str(write_config(uri, folder and Path(folder), default_permission="READ"))
    del os.environ["MLFLOW_AUTH_DATABASE_URI"]  # in the file now; not in the environment of every child
    beside = Path(sys.executable).parent / argv[0]  # this environment's `mlflow`, also when not on PATH
    if beside.exists():
        os.execv(str(beside), argv)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
