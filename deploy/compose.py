"""docker-compose.yml brought up and checked: `make stack-docker` runs `python -m deploy.compose up`.

    python3 -m deploy.compose up   [--env-file .env] [--no-build]   # secrets, build, up, wait healthy, deploy
    python3 -m deploy.compose down [--env-file .env]                 # stops; the volumes stay

`up` generates the missing secrets into the env file (mode 0600, deploy/env_file.py, as the native stack does),
before anything asks the engine (a fresh clone has no .env), then refuses with one line each, before anything starts
and changing nothing: no engine answering (naming how to start one), an empty secret, a published port that something
else holds, a database volume of another PostgreSQL major version. It builds the image (`build --force-rm` with v1: a
failed build leaves no exited containers), runs `up -d --no-build`, waits until every service is healthy, registers
the deployments of prefect.yaml from the worker (their schedules paused: prefect.yaml), and prints the two URLs and
where the credentials are. The compose client: $DIFFLM_COMPOSE (e.g. `/usr/bin/docker-compose`), else `docker
compose` (v2), else `docker-compose` (v1, Debian's); the hints it prints name the one it uses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

# standard library and deploy.env_file only: `make stack-docker` needs no virtual environment, just python3
from deploy.env_file import MLFLOW_ADMIN, SECRETS, ensure_secrets, read_env_file

ROOT = Path(__file__).resolve().parent.parent
PORTS = {"mlflow": ("MLFLOW_PORT", 5000), "prefect-server": ("PREFECT_PORT", 4200)}  # published on 127.0.0.1
HEALTHY = ("db", "mlflow", "prefect-server")  # the services with a healthcheck; the worker only runs
# the order the services depend on each other: when several failed, the first of them is named (a database that
# refused its volume also takes down the MLflow server that waited for it)
DEPENDENCY_ORDER = ("db", "mlflow", "prefect-server", "worker", "worker-gpu")
DEFAULT_SOCKET = "/var/run/docker.sock"  # where the clients look without DOCKER_HOST or a context
# how to start an engine that sees the images `python3 -m deploy.docker_local bases` cached (docs/production-stack.md)
START_ENGINE = (
    "`make docker-engine` starts one on the images cached by `python3 -m deploy.docker_local bases` and prints the "
    "`export DOCKER_HOST=...` to run (docs/production-stack.md), or start the system's (`systemctl start docker`)"
)


class ComposeError(SystemExit):
    """Bad input or a failed start, said in one line."""


def compose_client() -> list[str]:
    chosen = os.environ.get("DIFFLM_COMPOSE")
    if chosen:
        argv = shlex.split(chosen)
        if not argv or not shutil.which(argv[0]):
            raise ComposeError(f"DIFFLM_COMPOSE={chosen!r}: no such program; unset it or name a compose client")
        return argv
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    if shutil.which("docker-compose"):
        return [shutil.which("docker-compose") or "docker-compose"]
    raise ComposeError(
        "no Docker Compose: as root, `make docker` (Debian's docker.io and docker-compose), or install Docker with its "
        "compose plugin (docs.docker.com/compose/install)"
    )


def docker_host(env: Mapping[str, str]) -> str | None:
    """The engine the clients will ask: DOCKER_HOST, else the default socket; None where a Docker context chooses
    (the clients know it better than we do)."""
    if env.get("DOCKER_HOST"):
        return env["DOCKER_HOST"]
    if env.get("DOCKER_CONTEXT") not in (None, "", "default"):
        return None
    config = Path(env.get("DOCKER_CONFIG") or Path.home() / ".docker") / "config.json"
    try:
        current = json.loads(config.read_text()).get("currentContext")
    except (OSError, ValueError, AttributeError):
        current = None
    return None if current not in (None, "", "default") else f"unix://{DEFAULT_SOCKET}"


def engine_answers(socket_path: str, timeout: float = 10) -> bool:
    """Whether a Docker engine answers its API's ping on this unix socket. Asked directly, not through a client:
    a client without an engine says only `FileNotFoundError: [Errno 2] No such file or directory` (compose v1)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        try:
            s.connect(socket_path)
            s.sendall(b"GET /_ping HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n")
            status = s.recv(64).split(b"\r\n", 1)[0].split()
        except PermissionError:
            raise ComposeError(
                f"no permission on the Docker engine's socket {socket_path}: run as root or join the group `docker`"
            ) from None
        except OSError:
            return False
    return len(status) >= 2 and status[0].startswith(b"HTTP/") and status[1] == b"200"


def check_engine(env: Mapping[str, str]) -> None:
    """No engine answering: one line naming Docker and how to start one (a tcp:// or ssh:// host, or a context, is
    left to the clients, which then say what fails)."""
    host = docker_host(env)
    if host is None or not host.startswith("unix://") or engine_answers(host.removeprefix("unix://")):
        return
    if not (env.get("DIFFLM_COMPOSE") or shutil.which("docker") or shutil.which("docker-compose")):
        raise ComposeError(
            "Docker is not installed: as root, `make docker` (Debian's docker.io and docker-compose); then "
            + START_ENGINE
        )
    raise ComposeError(f"no Docker engine answers at {host}: {START_ENGINE}")


class Compose:
    """The compose client on docker-compose.yml of `project_dir`, with `env_file` as its variables."""

    def __init__(self, env_file: Path, project_dir: Path = ROOT, client: list[str] | None = None, env=None):
        self.env_file, self.project_dir = Path(env_file).resolve(), Path(project_dir)
        self.client = client or compose_client()
        self.env = dict(env if env is not None else os.environ)

    def run(self, *args: str, check: bool = True, capture: bool = True, timeout: float | None = None):
        argv = [*self.client, "--project-directory", str(self.project_dir), "--env-file", str(self.env_file)]
        argv += ["-f", str(self.project_dir / "docker-compose.yml"), *args]
        done = subprocess.run(argv, env=self.env, capture_output=capture, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise ComposeError(_first_error(done.stderr or "") or f"{' '.join(args[:2])} failed ({done.returncode})")
        return done

    @property
    def project(self) -> str:
        """Compose's project name: COMPOSE_PROJECT_NAME, else the project folder's name as Compose normalises it."""
        return self.env.get("COMPOSE_PROJECT_NAME") or re.sub(
            r"[^a-z0-9_-]", "", self.project_dir.resolve().name.lower()
        )

    def docker(self, *args: str) -> subprocess.CompletedProcess:
        docker = self.env.get("DIFFLM_DOCKER") or shutil.which("docker") or "docker"
        return subprocess.run([docker, *args], env=self.env, capture_output=True, text=True)

    def containers(self) -> dict[str, dict]:
        """service -> docker inspect's State of its container (services not created are absent)."""
        # by the project's label, not `compose ps`: that needs every secret set to read the file
        ids = self.docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}").stdout.split()
        if not ids:
            return {}
        out = json.loads(self.docker("inspect", *ids).stdout or "[]")
        return {c["Config"]["Labels"].get("com.docker.compose.service", c["Name"]): c["State"] for c in out}

    def variables(self) -> dict[str, str]:
        """What compose interpolates: the environment over the env file (none yet on a fresh clone)."""
        present = read_env_file(self.env_file) if self.env_file.exists() else {}
        return {**present, **{k: v for k, v in self.env.items()}}

    @property
    def name(self) -> str:
        """The client as the hints should name it: `docker compose` (v2) or `docker-compose` (v1), with the env
        file when it is not the project's .env."""
        name = "docker compose" if self.client[-1] == "compose" else "docker-compose"
        if self.env_file != (self.project_dir / ".env").resolve():
            name += f" --env-file {self.env_file}"
        return name


def _first_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if "ERROR" in ln or "error" in ln.lower():
            return ln.removeprefix("ERROR: ")
    return lines[-1] if lines else ""


def ports(c: Compose) -> dict[str, int]:
    values, out = c.variables(), {}
    for service, (var, default) in PORTS.items():
        raw = values.get(var) or str(default)
        if not raw.isdigit() or not 0 < int(raw) < 65536:
            raise ComposeError(f"{var}={raw!r} in {c.env_file}: a port number (1-65535)")
        out[service] = int(raw)
    return out


def prepare_secrets(env_file: Path, env: Mapping[str, str]) -> None:
    """An empty secret refused; the missing ones generated into `env_file` (created, 0600, on a fresh clone)."""
    env_file = Path(env_file)
    present = read_env_file(env_file) if env_file.exists() else {}
    values = {**present, **env}
    empty = [k for k in SECRETS if k in values and not values[k]]
    if empty:
        raise ComposeError(
            f"{', '.join(empty)} empty in {env_file}: delete the line (`up` then generates it) or set a value "
            f"(openssl rand -hex 24)"
        )
    ensure_secrets(env_file, {**present, **{k: env[k] for k in SECRETS if env.get(k)}})


def check_ports(c: Compose, running: set[str]) -> None:
    """A published port held by something else (not this stack's container) is refused before anything starts."""
    for service, port in ports(c).items():
        if service in running:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                var = PORTS[service][0]
                raise ComposeError(
                    f"port {port} on 127.0.0.1 is taken (wanted by {service}): stop what listens there, or set "
                    f"{var}=<a free port> in {c.env_file}"
                ) from None


def _old_cluster(old: str, new: str) -> str:
    return (
        f"the database volume holds a PostgreSQL {old} cluster and this image runs {new}: nothing was changed; dump "
        f"it with a PostgreSQL {old} image (pg_dumpall) and restore into a fresh volume (docs/production-stack.md)"
    )


def check_database_volume(c: Compose) -> None:
    """A database volume of another PostgreSQL major version is refused before anything starts (else the database
    exits at start, and the services waiting for it with it). Skipped when the volume or the image is not there yet
    or the image cannot say its version: the start itself then says it (`diagnose`)."""
    volume = f"{c.project}_db"
    if c.docker("volume", "inspect", volume).returncode != 0:
        return
    image = c.variables().get("DIFFLM_POSTGRES_IMAGE") or "postgres:15"
    if c.docker("image", "inspect", image).returncode != 0:
        return
    ran = c.docker(
        "run", "--rm", "--network", "none", "-v", f"{volume}:/v:ro", "--entrypoint", "cat", image, "/v/PG_VERSION"
    )
    has = ran.stdout.strip()
    runs = re.search(
        r"PostgreSQL\)\s+(\d+)",
        c.docker("run", "--rm", "--network", "none", "--entrypoint", "postgres", image, "-V").stdout,
    )
    if ran.returncode == 0 and has.isdigit() and runs and has != runs[1]:
        raise ComposeError(_old_cluster(has, runs[1]))


def diagnose(c: Compose, service: str) -> str:
    """One line on why `service` did not come up, from its log."""
    log = c.run("logs", "--no-color", "--tail", "60", service, check=False).stdout or ""
    old = re.search(r"initialized by PostgreSQL version (\d+), which is not compatible with this version (\d+)", log)
    if old:
        return _old_cluster(old[1], old[2])
    denied = re.search(r"Permission denied: '(/[^']+)'", log)
    if denied:
        return (
            f"{service} cannot write {denied[1]}: its volume comes from an older image that ran as root; "
            f"`{c.name} run --rm --user root {service} chown -R 10001:10001 {denied[1]}` fixes the owner"
        )
    last = [ln for ln in log.splitlines() if ln.strip()][-1:] or ["(no log)"]
    return f"{service} did not become healthy: {last[0].strip()[:300]} ({c.name} logs {service})"


def failed_services(states: dict[str, dict]) -> list[str]:
    """The services that exited or are unhealthy, those the others depend on first."""
    bad = [
        n
        for n, st in states.items()
        if st.get("Status") in ("exited", "dead") or (st.get("Health") or {}).get("Status") == "unhealthy"
    ]
    return sorted(bad, key=lambda n: DEPENDENCY_ORDER.index(n) if n in DEPENDENCY_ORDER else len(DEPENDENCY_ORDER))


def wait_healthy(c: Compose, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        states = c.containers()
        failed = failed_services(states)
        if failed:
            raise ComposeError(diagnose(c, failed[0]))
        if all((states.get(n, {}).get("Health") or {}).get("Status") == "healthy" for n in HEALTHY) and states.get(
            "worker", {}
        ).get("Running"):
            return
        if time.monotonic() > deadline:
            waiting = [n for n in HEALTHY if (states.get(n, {}).get("Health") or {}).get("Status") != "healthy"]
            raise ComposeError(f"not healthy after {timeout:.0f} s: {', '.join(waiting)} ({c.name} logs)")
        time.sleep(2)


def build_images(c: Compose, timeout: float) -> None:
    """`build`, its progress on the terminal. With v1 (the classic builder) `--force-rm`: a failed step's container
    is removed too (without it every failed build left an exited container); v2 builds with BuildKit, which leaves
    none. The build arguments come from the file: BASE_IMAGE and TORCH_INDEX_URL (the same as the cached stages of
    `python3 -m deploy.docker_local bases`, from .env, so the dependency layer is not rebuilt from an index this
    host cannot reach)."""
    done = c.run("build", *(["--force-rm"] if c.client[-1] != "compose" else []), check=False, capture=False)
    if done.returncode != 0:
        raise ComposeError(
            f"the image build failed (its output above); `{c.name} build` retries it, `python3 -m deploy.compose up "
            f"--no-build` starts the images there are"
        )


def up(c: Compose, build: bool = True, timeout: float = 600) -> dict[str, int]:
    """Secrets, checks, build, `up -d`, healthy, deployments registered; returns the published ports."""
    prepare_secrets(c.env_file, c.env)
    check_engine(c.env)
    running = {n for n, st in c.containers().items() if st.get("Running")}
    check_ports(c, running)
    check_database_volume(c)
    if build:
        build_images(c, timeout)
    done = c.run("up", "-d", "--no-build", check=False, capture=True, timeout=timeout)
    if done.returncode != 0:
        failed = failed_services(c.containers())
        raise ComposeError(diagnose(c, failed[0]) if failed else _first_error(done.stderr) or "compose up failed")
    wait_healthy(c, timeout)
    # the deployments of prefect.yaml (tiny-cpu, ...), registered from the worker's image (idempotent)
    c.run("exec", "-T", "-w", "/app", "worker", "prefect", "--no-prompt", "deploy", "--all", timeout=timeout)
    return ports(c)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.compose", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--env-file", type=Path, default=ROOT / ".env", help="the secrets (deploy/stack.env.example)")
    p.add_argument("--no-build", action="store_true", help="use the images as they are")
    a = p.parse_args(argv)
    try:
        if a.action == "up":  # the secrets first: they need no engine, and the next run finds them
            prepare_secrets(a.env_file, os.environ)
        check_engine(os.environ)
        c = Compose(a.env_file)
        if a.action == "down":
            c.run("down", capture=False)
            print(f"stopped; the volumes (database, artifacts, workdir) stay: `{c.name} down -v` drops them")
            return 0
        got = up(c, build=not a.no_build)
    except ComposeError as err:
        print(err.code, file=sys.stderr)
        return 1
    print(
        f"MLflow  http://127.0.0.1:{got['mlflow']} (user {MLFLOW_ADMIN}, password MLFLOW_ADMIN_PASSWORD in "
        f"{a.env_file})\nPrefect http://127.0.0.1:{got['prefect-server']} (log in with PREFECT_AUTH_STRING of "
        f"{a.env_file})\nrun: {c.name} exec worker prefect deployment run 'pretrain-difflm/tiny-cpu' --watch\n"
        f"logs: {c.name} logs -f SERVICE; stop: python3 -m deploy.compose down (the volumes stay)\n"
        f"the schedules are paused (nightly-end-to-end at 03:00 UTC: docs/production-stack.md says how to resume it)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
