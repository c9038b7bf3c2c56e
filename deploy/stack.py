"""The production services, one definition for docker-compose.yml and for a native start without Docker:
PostgreSQL (one cluster, databases `mlflow` and `prefect`), an MLflow server on PostgreSQL with served
artifacts, a Prefect server on PostgreSQL, and a process worker polling the work pool `difflm`.

    python -m deploy.stack up   [--dir .difflm-stack] [--env-file .env] [--mlflow-port 5000] ...
    python -m deploy.stack down [--dir .difflm-stack]

Secrets come from an env file (`.env`, git-ignored; template deploy/stack.env.example). tests/test_production_stack.py
checks that docker-compose.yml runs the commands and environments `services()` gives for its network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from data_prep import corpus
from difflm import OFFLINE_ENV

ROOT = Path(__file__).resolve().parent.parent
INIT_SCRIPT = ROOT / "deploy" / "postgres-init.sh"
SECRETS = ("POSTGRES_PASSWORD", "MLFLOW_DB_PASSWORD", "PREFECT_DB_PASSWORD")
WORK_POOL = "difflm"
IMAGE_ENV = OFFLINE_ENV  # the Dockerfile's ENV: what a native start gives every service too


@dataclass
class Stack:
    """Where the services listen and how they reach each other; passwords are values or `${VAR}` placeholders."""

    secrets: dict[str, str]
    host: str = "127.0.0.1"  # what the servers bind to
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

    def db_url(self, scheme: str, name: str) -> str:
        pw = self.secrets[f"{name.upper()}_DB_PASSWORD"]
        pw = pw if pw.startswith("${") else quote(pw, safe="")  # a compose placeholder stays as written
        return f"{scheme}://{name}:{pw}@{self.db_host}:{self.db_port}/{name}"


@dataclass
class Service:
    argv: list[str]
    env: dict[str, str]


def services(s: Stack) -> dict[str, Service]:
    """Command line and environment of each server (PostgreSQL is started by its image or by `up`)."""
    # psycopg2 named: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; the URL in env keeps it out of `ps`
    mlflow_env = {
        "MLFLOW_BACKEND_STORE_URI": s.db_url("postgresql+psycopg2", "mlflow"),
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }  # 7 job workers (~2 GB) we do not use
    if s.mlflow_allowed_hosts:
        mlflow_env["MLFLOW_SERVER_ALLOWED_HOSTS"] = s.mlflow_allowed_hosts
    prefect_api = f"http://{s.prefect_host}:{s.prefect_port}/api"
    return {
        "mlflow": Service(
            [
                "mlflow",
                "server",
                "--host",
                s.host,
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
            },
        ),
        "worker": Service(
            ["prefect", "worker", "start", "--pool", WORK_POOL, "--type", "process"],
            {
                "PREFECT_API_URL": prefect_api,
                "MLFLOW_TRACKING_URI": f"http://{s.mlflow_host}:{s.mlflow_port}",
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


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (comments and blanks skipped; values may be quoted), as docker compose reads them."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip().strip("'\"")
    return out


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
    import pwd

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


def _http_ok(url: str):
    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
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
    pids = _pids(state)
    pids[name] = proc.pid
    (state / "pids.json").write_text(json.dumps(pids))
    return proc


def _pids(state: Path) -> dict[str, int]:
    f = state / "pids.json"
    return json.loads(f.read_text()) if f.exists() else {}


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
) -> Stack:
    """Start PostgreSQL, MLflow, Prefect and a worker natively under `state`; return when all are healthy and the
    worker has created its work pool. `cache`: the worker's DIFFLM_CACHE (default: this user's corpus cache)."""
    missing = [k for k in SECRETS if not secrets.get(k)]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: put them in .env (see deploy/stack.env.example)")
    if any(secrets[k].startswith("change-me") for k in SECRETS):
        raise SystemExit("replace the change-me values of .env (openssl rand -hex 24 each)")
    state = state.resolve()
    if _pids(state) and any(_alive(pid) for pid in _pids(state).values()):
        raise SystemExit(f"a stack is already running under {state}: python -m deploy.stack down --dir {state}")
    for sub in ("logs", "mlartifacts", "pg"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    bin_ = _pg_bin()
    pg, data = state / "pg", state / "pg" / "data"
    _db_user_owns(pg)
    env = {
        "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}",
        "PGHOST": "127.0.0.1",
        "PGPORT": str(db_port),
        "PGPASSWORD": secrets["POSTGRES_PASSWORD"],
        "PGUSER": "postgres",
        **secrets,
    }
    fresh = not (data / "PG_VERSION").exists()
    if fresh:
        (pg / "pwfile").write_text(secrets["POSTGRES_PASSWORD"] + "\n")
        _db_user_owns(pg / "pwfile")
        subprocess.run(
            _as_db_user(
                [
                    str(bin_ / "initdb"),
                    "-D",
                    str(data),
                    "-U",
                    "postgres",
                    "--auth=scram-sha-256",
                    f"--pwfile={pg / 'pwfile'}",
                ]
            ),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        (pg / "pwfile").unlink()
    db = _start(
        "postgres",
        _as_db_user([str(bin_ / "postgres"), "-D", str(data), "-h", host, "-p", str(db_port), "-k", str(pg)]),
        {},
        state,
        pg,
    )
    ready = lambda: subprocess.run([str(bin_ / "pg_isready"), "-q"], env={**os.environ, **env}).returncode == 0  # noqa: E731
    _wait(ready, "postgres", db, state / "logs" / "postgres.log", timeout)
    if fresh:
        subprocess.run(["sh", str(INIT_SCRIPT)], env={**os.environ, **env}, check=True, stdout=subprocess.DEVNULL)

    stack = Stack(
        secrets,
        host=host,
        db_host="127.0.0.1",
        db_port=db_port,
        mlflow_host=host,
        mlflow_port=mlflow_port,
        prefect_host=host,
        prefect_port=prefect_port,
        artifacts=str(state / "mlartifacts"),
        cache=str(Path(cache or corpus.cache_dir()).resolve()),
        extra_env={"PREFECT_HOME": str(state / "prefect-worker"), **IMAGE_ENV},
    )
    svc = services(stack)
    bin_dir = Path(sys.executable).parent  # the servers of this environment, as in the image
    runs = {}
    for name in ("mlflow", "prefect-server"):
        s = svc[name]
        runs[name] = _start(
            name,
            [str(bin_dir / s.argv[0]), *s.argv[1:]],
            {**s.env, "PREFECT_HOME": str(state / f"{name}-home")},
            state,
            state,
        )
    _wait(
        _http_ok(f"http://{host}:{mlflow_port}/health"),
        "mlflow",
        runs["mlflow"],
        state / "logs" / "mlflow.log",
        timeout,
    )
    _wait(
        _http_ok(f"http://{host}:{prefect_port}/api/health"),
        "prefect-server",
        runs["prefect-server"],
        state / "logs" / "prefect-server.log",
        timeout,
    )
    w = svc["worker"]
    worker = _start("worker", [str(bin_dir / w.argv[0]), *w.argv[1:]], w.env, state, state)
    # the worker creates its pool when it is missing; deployments of the pool can be registered from then on
    _wait(
        _http_ok(f"http://{host}:{prefect_port}/api/work_pools/{WORK_POOL}"),
        "worker",
        worker,
        state / "logs" / "worker.log",
        timeout,
    )
    return stack


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
    pids, stopped = _pids(state), []
    for name, pid in reversed(list(pids.items())):
        sig = signal.SIGINT if name == "postgres" else signal.SIGTERM  # SIGTERM would wait for clients
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
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--dir", type=Path, default=Path(".difflm-stack"), help="state: database, artifacts, logs")
    p.add_argument("--env-file", type=Path, default=Path(".env"), help="the secrets (see deploy/stack.env.example)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--db-port", type=int, default=5432)
    p.add_argument("--mlflow-port", type=int, default=5000)
    p.add_argument("--prefect-port", type=int, default=4200)
    p.add_argument(
        "--cache", type=Path, help="the worker's DIFFLM_CACHE (default: $DIFFLM_CACHE or ~/.cache/difflm-pipeline)"
    )
    a = p.parse_args(argv)
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
    try:
        s = up(a.dir, secrets, a.host, a.db_port, a.mlflow_port, a.prefect_port, a.cache)
    except BaseException:
        down(a.dir)
        raise
    print(
        f"MLflow  http://{s.host}:{s.mlflow_port}\nPrefect http://{s.host}:{s.prefect_port}  "
        f"(export PREFECT_API_URL=http://{s.host}:{s.prefect_port}/api MLFLOW_TRACKING_URI=http://{s.host}:{s.mlflow_port})\n"
        f"worker polling pool '{WORK_POOL}'; logs in {a.dir}/logs; stop: python -m deploy.stack down --dir {a.dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
