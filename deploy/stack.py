"""The production services, one definition for docker-compose.yml and for a native start without Docker:
PostgreSQL (one cluster, databases `mlflow` and `prefect`), an MLflow server on PostgreSQL with served
artifacts, a Prefect server on PostgreSQL, and a process worker polling the work pool `difflm`.

    python -m deploy.stack secrets [--env-file .env]   # generate the secrets (mode 0600), for Compose too
    python -m deploy.stack up   [--dir .difflm-stack] [--env-file .env] [--mlflow-port 5000] ...
    python -m deploy.stack down [--dir .difflm-stack]

Secrets come from an env file (`.env`, git-ignored, mode 0600; template deploy/stack.env.example); `up` generates
the missing ones into it. Secure by default: the Prefect API requires its auth string (root-equivalent on the
worker: Prefect OSS has no roles), checks CSRF tokens and allows only the UI's origin; MLflow runs its basic-auth
app (admin password generated, users in PostgreSQL); PostgreSQL and Prefect listen on loopback, MLflow on
--mlflow-host (the cluster nodes log to it). `up` writes `<dir>/client.env` (0600) for clients to source.
tests/integration/test_production_stack.py checks that docker-compose.yml runs the commands and environments `services()`
gives for its network.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from deploy import mlflow_auth
from deploy.env_file import MLFLOW_ADMIN, SECRETS, ensure_secrets, read_env_file, write_private
from difflm import OFFLINE_ENV
from difflm.data_prep import corpus
from difflm.outputs import private_umask

ROOT = Path(__file__).resolve().parent.parent
INIT_SCRIPT = ROOT / "deploy" / "postgres-init.sh"
WORK_POOL = "difflm"
AUTH_DIR = "mlflow-auth"  # <state>/mlflow-auth/basic_auth.ini: the MLflow auth app's ini, 0600, removed by `down`
IMAGE_ENV = OFFLINE_ENV  # the Dockerfile's ENV: what a native start gives every service too


@dataclass
class Stack:
    """Where the services listen and how they reach each other; passwords are values or `${VAR}` placeholders."""

    secrets: dict[str, str]
    host: str = "127.0.0.1"  # what PostgreSQL and the Prefect server bind to
    mlflow_bind: str | None = None  # what the MLflow server binds to (None: host); cluster nodes log to it
    db_host: str = "127.0.0.1"  # how the servers reach PostgreSQL
    db_port: int = 5432
    mlflow_host: str = "127.0.0.1"  # how the worker reaches the servers
    mlflow_port: int = 5000
    prefect_host: str = "127.0.0.1"
    prefect_port: int = 4200
    artifacts: str = ".difflm-stack/mlartifacts"
    cache: str = ".difflm-stack/cache"
    mlflow_allowed_hosts: str | None = None  # MLflow accepts only loopback/private-IP Host headers by default
    mlflow_workers: int = 1  # uvicorn processes (MLflow's default, 4, costs ~1 GB for one pipeline)
    extra_env: dict[str, str] = field(default_factory=dict)

    def db_url(self, scheme: str, name: str, database: str | None = None) -> str:
        pw = self.secrets[f"{name.upper()}_DB_PASSWORD"]
        pw = pw if pw.startswith("${") else quote(pw, safe="")  # a compose placeholder stays as written
        return f"{scheme}://{name}:{pw}@{self.db_host}:{self.db_port}/{database or name}"

    @property
    def prefect_ui_origin(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}"  # the UI as published (loopback) and reached by users


@dataclass
class Service:
    argv: list[str]
    env: dict[str, str]


def services(s: Stack) -> dict[str, Service]:
    """Command line and environment of each server (PostgreSQL is started by its image or by `up`)."""
    # psycopg2 named: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; the URL in env keeps it out of `ps`
    mlflow_env = {
        "MLFLOW_BACKEND_STORE_URI": s.db_url("postgresql+psycopg2", "mlflow"),
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # 7 job workers (~2 GB) we do not use
        # the basic-auth app: users in their own database, admin password and session secret generated
        "MLFLOW_AUTH_DATABASE_URI": s.db_url("postgresql+psycopg2", "mlflow", "mlflow_auth"),
        "MLFLOW_AUTH_ADMIN_PASSWORD": s.secrets["MLFLOW_ADMIN_PASSWORD"],
        "MLFLOW_FLASK_SERVER_SECRET_KEY": s.secrets["MLFLOW_SECRET_KEY"],
        "MLFLOW_SERVER_CORS_ALLOWED_ORIGINS": f"http://127.0.0.1:{s.mlflow_port},http://localhost:{s.mlflow_port}",
    }
    if s.mlflow_allowed_hosts:
        mlflow_env["MLFLOW_SERVER_ALLOWED_HOSTS"] = s.mlflow_allowed_hosts
    prefect_api = f"http://{s.prefect_host}:{s.prefect_port}/api"
    return {
        "mlflow": Service(
            [
                "python",
                "-m",
                "deploy.mlflow_auth",
                "mlflow",
                "server",
                "--app-name",
                "basic-auth",
                "--host",
                s.mlflow_bind or s.host,
                "--port",
                str(s.mlflow_port),
                "--workers",
                str(s.mlflow_workers),
                "--artifacts-destination",
                s.artifacts,
                "--serve-artifacts",
            ],
            mlflow_env,
        ),
        "prefect-server": Service(
            ["prefect", "server", "start", "--host", s.host, "--port", str(s.prefect_port)],
            {
                "PREFECT_SERVER_DATABASE_CONNECTION_URL": s.db_url("postgresql+asyncpg", "prefect"),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_UI_API_URL": f"http://127.0.0.1:{s.prefect_port}/api",
                # anyone who reaches an open Prefect API runs code on the worker: credentials, CSRF, one origin
                "PREFECT_SERVER_API_AUTH_STRING": s.secrets["PREFECT_AUTH_STRING"],
                "PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED": "true",
                "PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": s.prefect_ui_origin,
            },
        ),
        "worker": Service(
            ["prefect", "worker", "start", "--pool", WORK_POOL, "--type", "process"],
            {
                "PREFECT_API_URL": prefect_api,
                "PREFECT_API_AUTH_STRING": s.secrets["PREFECT_AUTH_STRING"],
                "MLFLOW_TRACKING_URI": f"http://{s.mlflow_host}:{s.mlflow_port}",
                "MLFLOW_TRACKING_USERNAME": MLFLOW_ADMIN,
                "MLFLOW_TRACKING_PASSWORD": s.secrets["MLFLOW_ADMIN_PASSWORD"],
                "DIFFLM_CACHE": s.cache,
                **s.extra_env,
            },
        ),
    }


def compose_stack() -> Stack:
    """The stack as docker-compose.yml runs it: service names as hosts, secrets interpolated from .env."""
    return Stack(
        secrets={k: f"${{{k}:?set in .env, see deploy/stack.env.example}}" for k in SECRETS},
        host="0.0.0.0",
        db_host="db",
        mlflow_host="mlflow",
        prefect_host="prefect-server",
        artifacts="/mlartifacts",
        cache="/data/cache",
        mlflow_allowed_hosts="mlflow:5000,localhost:*,127.0.0.1:*",
    )


# ----- native start --------------------------------------------------------------------------------------------


def _pg_bin() -> Path:
    if os.environ.get("PG_BIN"):
        return Path(os.environ["PG_BIN"])
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if found:
        return found[-1].parent  # Debian's postgresql-NN package
    if shutil.which("initdb"):
        return Path(shutil.which("initdb")).parent
    raise SystemExit("PostgreSQL not found: install it (apt-get install postgresql) or set PG_BIN")


def _db_user():
    """PostgreSQL refuses to run as root: as root, it runs as the `postgres` system user (else `nobody`)."""
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        return pwd.getpwnam("nobody")


def _as_db_user(argv: list[str]) -> list[str]:
    return argv if os.geteuid() != 0 else ["runuser", "-u", _db_user().pw_name, "--", *argv]


def _db_user_owns(path: Path) -> None:
    if os.geteuid() == 0:
        entry = _db_user()
        os.chown(path, entry.pw_uid, entry.pw_gid)
        if subprocess.run(_as_db_user(["test", "-w", str(path)])).returncode != 0:
            raise SystemExit(f"{path} is not reachable by the database user: every parent folder needs o+x")


def _wait(check, what: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}; see {log}:\n{log.read_text()[-3000:]}")
        if check():
            return
        time.sleep(0.5)
    raise SystemExit(f"{what} not ready after {timeout:.0f} s; see {log}")


def _http_ok(url: str, auth: str | None = None):
    """A readiness check of `url` (`auth`: user:password for HTTP basic auth)."""
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}

    def check() -> bool:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    return check


MARKER = "DIFFLM_STACK"  # in the environment of every process `up` starts: `down` finds what a service left behind


def _start(name: str, argv: list[str], env: dict[str, str], state: Path, cwd: Path) -> subprocess.Popen:
    log = state / "logs" / f"{name}.log"
    proc = subprocess.Popen(
        argv,
        env={**os.environ, **env, MARKER: str(state)},
        cwd=cwd,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # own group: `down` stops it whole
    records = _records(state)
    records[name] = {"pid": proc.pid, "start": _start_time(proc.pid)}
    (state / "pids.json").write_text(json.dumps(records))
    return proc


def _records(state: Path) -> dict[str, dict]:
    """pids.json: {service: {"pid", "start" (its start time in clock ticks since boot, /proc/PID/stat)}}."""
    f = state / "pids.json"
    data = json.loads(f.read_text()) if f.exists() else {}
    return {k: v if isinstance(v, dict) else {"pid": int(v), "start": None} for k, v in data.items()}


def _pids(state: Path) -> dict[str, int]:
    return {k: v["pid"] for k, v in _records(state).items()}


def _start_time(pid: int) -> int | None:
    st = _stat(pid)
    return int(st[19]) if len(st) > 19 else None  # field 22 of /proc/PID/stat, the 20th after the name


def _is_ours(pid: int, start: int | None, state: Path) -> bool:
    """Whether `pid` is still the process `up` started: the same start time as recorded (a reused pid has
    another), or, for records without one, the stack's marker in its environment."""
    if start is not None:
        return _start_time(pid) == start
    try:
        tag = f"{MARKER}={Path(state).resolve()}".encode()
        return tag in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def stack_processes(state: Path) -> list[int]:
    """Processes started for the stack under `state` that are still there: the services, their children and
    whatever left their process group (Prefect starts each flow run in a session of its own). Linux /proc."""
    tag = f"{MARKER}={Path(state).resolve()}".encode()
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if tag in (d / "environ").read_bytes().split(b"\0") and int(d.name) != os.getpid():
                found.append(int(d.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def up(
    state: Path,
    secrets: dict[str, str],
    host: str = "127.0.0.1",
    db_port: int = 5432,
    mlflow_port: int = 5000,
    prefect_port: int = 4200,
    cache: Path | None = None,
    timeout: float = 180,
    mlflow_bind: str | None = None,
) -> Stack:
    """Start PostgreSQL, MLflow, Prefect and a worker natively under `state`; return when all are healthy and the
    worker has created its work pool. `cache`: the worker's DIFFLM_CACHE (default: this user's corpus cache)."""
    check_secrets(secrets)
    state = state.resolve()
    prepare_state(state)
    start_database(state, secrets, host, db_port, timeout)
    mlflow_at = host if mlflow_bind in (None, "0.0.0.0", "::") else mlflow_bind  # where this host reaches it
    stack = Stack(
        secrets,
        host=host,
        mlflow_bind=mlflow_bind,
        db_host="127.0.0.1",
        db_port=db_port,
        mlflow_host=mlflow_at,
        mlflow_port=mlflow_port,
        prefect_host=host,
        prefect_port=prefect_port,
        artifacts=str(state / "mlartifacts"),
        cache=str(Path(cache or corpus.cache_dir()).resolve()),
        extra_env={"PREFECT_HOME": str(state / "prefect-worker"), **IMAGE_ENV},
    )
    start_servers(stack, state, timeout)
    start_worker(stack, state, timeout)
    write_private(state / "client.env", client_env(stack))
    return stack


def check_secrets(secrets: dict[str, str]) -> None:
    """Every secret set, none left at the template's change-me value."""
    missing = [k for k in SECRETS if not secrets.get(k)]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: put them in .env (see deploy/stack.env.example)")
    if any(secrets[k].startswith("change-me") for k in SECRETS):
        raise SystemExit("replace the change-me values of .env (openssl rand -hex 24 each)")


def prepare_state(state: Path) -> None:
    """The state folder's layout and modes; refuses a folder whose stack is still running."""
    if any(_alive(r["pid"]) and _is_ours(r["pid"], r["start"], state) for r in _records(state).values()):
        raise SystemExit(f"a stack is already running under {state}: python -m deploy.stack down --dir {state}")
    for sub in ("logs", "mlartifacts", "pg"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    for private in ("logs", "mlartifacts"):  # models, configs, logs: this user's (the servers run as this user)
        os.chmod(state / private, 0o700)
    if os.geteuid() == 0:  # the database user must traverse the state folder to its own pg/ (o+x: no listing)
        os.chmod(state, state.stat().st_mode | 0o001)


def start_database(state: Path, secrets: dict[str, str], host: str, db_port: int, timeout: float) -> None:
    """PostgreSQL under <state>/pg, created on the first start, with the databases of MLflow and Prefect."""
    bin_ = _pg_bin()
    pg, data = state / "pg", state / "pg" / "data"
    _db_user_owns(pg)
    env = {
        **os.environ,
        "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}",
        "PGHOST": "127.0.0.1",
        "PGPORT": str(db_port),
        "PGPASSWORD": secrets["POSTGRES_PASSWORD"],
        "PGUSER": "postgres",
        **secrets,
    }
    fresh = not (data / "PG_VERSION").exists()
    if fresh:
        _initdb(bin_, pg, data, secrets["POSTGRES_PASSWORD"])
    argv = [str(bin_ / "postgres"), "-D", str(data), "-h", host, "-p", str(db_port), "-k", str(pg)]
    db = _start("postgres", _as_db_user(argv), {}, state, pg)
    ready = lambda: subprocess.run([str(bin_ / "pg_isready"), "-q"], env=env).returncode == 0  # noqa: E731
    _wait(ready, "postgres", db, state / "logs" / "postgres.log", timeout)
    if fresh:
        subprocess.run(["sh", str(INIT_SCRIPT)], env=env, check=True, stdout=subprocess.DEVNULL)
    else:
        _ensure_auth_database(bin_, env)


def _initdb(bin_: Path, pg: Path, data: Path, password: str) -> None:
    pwfile = pg / "pwfile"
    try:  # readable by its owner only from the start, and gone however initdb ends
        write_private(pwfile, password + "\n")
        _db_user_owns(pwfile)
        argv = [str(bin_ / "initdb"), "-D", str(data), "-U", "postgres", "--auth=scram-sha-256", f"--pwfile={pwfile}"]
        subprocess.run(_as_db_user(argv), check=True, stdout=subprocess.DEVNULL)
    finally:
        pwfile.unlink(missing_ok=True)


def _ensure_auth_database(bin_: Path, env: dict[str, str]) -> None:
    """A cluster from before MLflow's auth app: its user database."""
    psql = [str(bin_ / "psql"), "-tA", "-d", "postgres", "-c"]
    has = subprocess.run(
        [*psql, "SELECT 1 FROM pg_database WHERE datname = 'mlflow_auth'"], env=env, capture_output=True, text=True
    )
    if has.stdout.strip() != "1":
        subprocess.run([*psql, "CREATE DATABASE mlflow_auth OWNER mlflow"], env=env, check=True)


def start_servers(stack: Stack, state: Path, timeout: float) -> None:
    """MLflow and the Prefect server, from this environment's executables (as in the image), until healthy."""
    svc = services(stack)
    health = {
        "mlflow": f"http://{stack.mlflow_host}:{stack.mlflow_port}/health",
        "prefect-server": f"http://{stack.host}:{stack.prefect_port}/api/health",
    }
    runs = {}
    for name in health:
        s = svc[name]
        argv = [str(Path(sys.executable).parent / s.argv[0]), *s.argv[1:]]
        env = {**s.env, "PREFECT_HOME": str(state / f"{name}-home"), "PYTHONPATH": str(ROOT)}  # deploy.mlflow_auth
        if name == "mlflow":  # its auth ini (the auth database's password) where `down` removes it
            env[mlflow_auth.DIR_VAR] = str(state / AUTH_DIR)
        runs[name] = _start(name, argv, env, state, state)
    for name, url in health.items():
        _wait(_http_ok(url), name, runs[name], state / "logs" / f"{name}.log", timeout)


def start_worker(stack: Stack, state: Path, timeout: float) -> None:
    """The process worker; ready once it has created its work pool (deployments of the pool register from then)."""
    w = services(stack)["worker"]
    worker = _start("worker", [str(Path(sys.executable).parent / w.argv[0]), *w.argv[1:]], w.env, state, state)
    pool = f"http://{stack.host}:{stack.prefect_port}/api/work_pools/{WORK_POOL}"
    _wait(
        _http_ok(pool, stack.secrets["PREFECT_AUTH_STRING"]), "worker", worker, state / "logs" / "worker.log", timeout
    )


def client_env(s: Stack) -> str:
    """What a client of the stack exports (CLI, `prefect deploy`, trainers on cluster nodes): an env file."""
    values = {
        "PREFECT_API_URL": f"http://{s.prefect_host}:{s.prefect_port}/api",
        "PREFECT_API_AUTH_STRING": s.secrets["PREFECT_AUTH_STRING"],
        "MLFLOW_TRACKING_URI": f"http://{s.mlflow_host}:{s.mlflow_port}",
        "MLFLOW_TRACKING_USERNAME": MLFLOW_ADMIN,
        "MLFLOW_TRACKING_PASSWORD": s.secrets["MLFLOW_ADMIN_PASSWORD"],
    }
    return "".join(f"export {k}={v}\n" for k, v in values.items())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def down(state: Path, grace: float = 20) -> list[str]:
    """Stop what `up` started, newest first, each whole process group (PostgreSQL last, fast shutdown), then
    whatever the services started outside their groups (flow runs). Returns the services it found running."""
    state = Path(state).resolve()
    records, stopped = _records(state), []
    for name, rec in reversed(list(records.items())):
        pid = rec["pid"]
        sig = signal.SIGINT if name == "postgres" else signal.SIGTERM  # SIGTERM would wait for clients
        if not _is_ours(pid, rec["start"], state):
            continue  # gone, or the pid now names another process (a reboot, reuse): never signalled
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            continue
        stopped.append(name)
        deadline = time.time() + grace
        while time.time() < deadline:
            if not _group_alive(pid):
                break
            time.sleep(0.2)
        else:  # a Prefect worker may ignore SIGTERM for a while
            try:
                if _is_ours(pid, rec["start"], state):
                    os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = stack_processes(state)
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + (5 if sig == signal.SIGTERM else 2)
        while left and time.time() < deadline:
            left = [p for p in left if _alive(p) and not _zombie(p)]
            time.sleep(0.1)
    (state / "pids.json").unlink(missing_ok=True)
    (state / AUTH_DIR / mlflow_auth.INI).unlink(missing_ok=True)  # the file deploy.mlflow_auth wrote, only it
    with contextlib.suppress(OSError):  # kept if something else was put there
        (state / AUTH_DIR).rmdir()
    return stopped


def _stat(pid: int | str) -> list[str]:
    """Fields of /proc/PID/stat after the command name: state, ppid, pgrp, session, ..."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _zombie(pid: int) -> bool:
    return _stat(pid)[:1] == ["Z"]


def _group_alive(pgid: int) -> bool:
    """A member of the process group that is not a zombie (an exited one is reaped here when it is our child)."""
    try:
        os.waitpid(pgid, os.WNOHANG)
    except ChildProcessError:
        pass
    if not Path("/proc").is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for d in Path("/proc").glob("[0-9]*"):
        st = _stat(d.name)
        if len(st) > 2 and st[2] == str(pgid) and st[0] != "Z":
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.stack", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["up", "down", "secrets"])
    p.add_argument("--dir", type=Path, default=Path(".difflm-stack"), help="state: database, artifacts, logs")
    p.add_argument("--env-file", type=Path, default=Path(".env"), help="the secrets (see deploy/stack.env.example)")
    p.add_argument("--host", default="127.0.0.1", help="where PostgreSQL and Prefect listen (keep loopback)")
    p.add_argument("--mlflow-host", help="where MLflow listens (default: --host); e.g. 0.0.0.0 for cluster nodes")
    p.add_argument("--db-port", type=int, default=5432)
    p.add_argument("--mlflow-port", type=int, default=5000)
    p.add_argument("--prefect-port", type=int, default=4200)
    p.add_argument(
        "--cache", type=Path, help="the worker's DIFFLM_CACHE (default: $DIFFLM_CACHE or ~/.cache/difflm-pipeline)"
    )
    a = p.parse_args(argv)
    # the services' data (PostgreSQL, artifacts, Prefect state, the worker's runs) is not for other users of the
    # host: no access for others, inherited by every service and the trainers the worker starts
    with private_umask():
        return _run(a)


def _run(a: argparse.Namespace) -> int:
    if a.action == "down":
        if not (a.dir / "pids.json").exists():
            print(f"no stack in {a.dir.resolve()} (no pids.json): nothing to stop; pass the --dir given to `up`")
            return 1
        stopped = down(a.dir)
        print(f"stopped {', '.join(reversed(stopped))}" if stopped else f"nothing was running in {a.dir}")
        return 0
    secrets = {
        **(read_env_file(a.env_file) if a.env_file.exists() else {}),
        **{k: os.environ[k] for k in SECRETS if k in os.environ},
    }
    secrets = ensure_secrets(a.env_file, secrets)
    if a.action == "secrets":
        print(f"{a.env_file}: every secret set (mode 0600); docker-compose and `up` read it")
        return 0
    try:
        s = up(a.dir, secrets, a.host, a.db_port, a.mlflow_port, a.prefect_port, a.cache, mlflow_bind=a.mlflow_host)
    except BaseException:
        down(a.dir)
        raise
    print(
        f"MLflow  http://{s.mlflow_bind or s.host}:{s.mlflow_port} (user {MLFLOW_ADMIN}, password "
        f"MLFLOW_ADMIN_PASSWORD in {a.env_file})\nPrefect http://{s.host}:{s.prefect_port} (log in with "
        f"PREFECT_AUTH_STRING of {a.env_file})\n"
        f"clients: source {a.dir}/client.env (URLs and credentials, mode 0600)\n"
        f"worker polling pool '{WORK_POOL}'; logs in {a.dir}/logs; stop: python -m deploy.stack down --dir {a.dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
