"""docker-compose.yml on a real Docker engine, by the commands of docs/production-stack.md in their order, on a
host that reaches no image registry (issue 51: the test took its own path, and the documented one failed):

    python3 -m deploy.docker_local bases   # the cached images (in the background from the start of the session)
    make docker-engine                     # a private dockerd on them; the image names set in .env; prints ...
    export DOCKER_HOST=unix://...          # ... this line
    make stack-docker                      # secrets generated, build (the cached stages reused), up, healthy
    docker-compose exec worker prefect deployment run 'pretrain-difflm/tiny-cpu' --watch
    python3 -m deploy.compose down         # then make stack-docker again: the run is still there
    python3 -m deploy.docker_local stop

The env file starts as a fresh clone's (no secrets, no image names; only free ports, which the docs say to set when
5000 or 4200 is taken) and is the test's own (ENV_FILE=...), as is the Compose project (COMPOSE_PROJECT_NAME). The
test-tiny run goes through the Prefect API, MLflow (with credentials; anonymous gets 401) holds its run, metrics and
registered version, and after `down` and `up` again they are all still there; the nightly schedule stays paused.
Bad input (an empty or missing secret, a port already taken, a database volume of an older PostgreSQL) gets one line
and changes nothing. The test's containers, volumes and pipeline image are removed; the bases and the dependency and
runtime stages stay cached (~/.cache/difflm/docker).

`make test` installs the engine when root (`make docker`); without it the tests are skipped with the reason (under
CI: failed). The cached images are built in the background from the start of the session (tests/support/
docker_prebuild.py: about 6 minutes on a fresh host), so the build of `make stack-docker` builds only the project's
own layers."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import docker_prebuild
import pytest
from conftest import skip_or_fail
from mlflow.tracking import MlflowClient
from scenarios import SCENARIOS
from servers import free_ports

from deploy import compose, docker_local
from deploy.env_file import MLFLOW_ADMIN, SECRETS, ensure_secrets, read_env_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "difflm-pipeline:latest"
WORKDIR = "/data/difflm-test"  # in the worker's workdir volume


def _documented(argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """A command of docs/production-stack.md, run in the project root as a user types it."""
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _make(target: str, env_file: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return _documented(["make", "-s", "--no-print-directory", target, f"ENV_FILE={env_file}"], env, timeout)


class Stack:
    """The engine of `make docker-engine` and the environment the docs' commands run in after its export."""

    def __init__(self, daemon: docker_local.Daemon, env_file: Path, env: dict, times: dict):
        self.daemon, self.env_file, self.env, self.times = daemon, env_file, env, times

    def compose(self, env_file: Path, project: str) -> compose.Compose:
        """The Compose of this checkout as project `project`, for the test's own checks and clean-up."""
        env = {**self.env, "COMPOSE_PROJECT_NAME": project, "DIFFLM_DOCKER": docker_local.DOCKER}
        return compose.Compose(env_file, ROOT, [docker_local.COMPOSE], env)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`make docker-engine` on the cached images, with a fresh clone's env file; at the end the pipeline image goes
    and `python3 -m deploy.docker_local stop` stops the engine (unless it ran before the test)."""
    why = docker_local.unavailable()
    if why:
        skip_or_fail(why)
    t = time.monotonic()
    print(docker_prebuild.wait())  # `python3 -m deploy.docker_local bases`, begun at the start of the session
    times = {"waited for the background build": time.monotonic() - t}
    env_file = tmp_path_factory.mktemp("clone") / ".env"
    mlflow_port, prefect_port = free_ports(2)
    env_file.write_text(f"MLFLOW_PORT={mlflow_port}\nPREFECT_PORT={prefect_port}\n")
    ran_before = docker_local.running_engine() is not None
    t = time.monotonic()
    started = _make("docker-engine", env_file, dict(os.environ), timeout=1800)
    times["make docker-engine"] = time.monotonic() - t
    d = docker_local.engine_daemon()
    try:
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        export = started.stdout.strip().splitlines()[-1]
        assert export == f"export DOCKER_HOST={d.host}", started.stdout[-2000:]
        assert {k: read_env_file(env_file)[k] for k in docker_local.image_settings()} == docker_local.image_settings()
        yield Stack(d, env_file, {**os.environ, "DOCKER_HOST": d.host}, times)
    finally:
        d.docker("rmi", "-f", IMAGE, check=False)
        d.docker("image", "prune", "-f", check=False)  # the dangling layers of this build, not the tagged caches
        if not ran_before:
            stopped = _documented(["python3", "-m", "deploy.docker_local", "stop"], dict(os.environ), timeout=120)
            assert stopped.returncode == 0 and docker_local.running_engine() is None, stopped.stdout + stopped.stderr
        print("docker test times (s):", {k: round(v, 1) for k, v in times.items()})


def _request(url: str, auth: str | None = None) -> int:
    return _get(url, auth)[0]


def _get(url: str, auth: str | None = None) -> tuple[int, bytes]:
    h = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=h), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, b""


def _down(c: compose.Compose, volumes: bool) -> None:
    c.run("down", *(["-v"] if volumes else []), "--remove-orphans", timeout=120)


@pytest.mark.slow(
    reason="docker-compose.yml by the documented commands: the engine, the images built, the stack up, a flow run, "
    "down and up"
)
def test_compose_runs_the_pipeline_and_keeps_it_across_down_and_up(stack, monkeypatch):
    project = f"difflmtest{os.getpid()}"
    env = {**stack.env, "COMPOSE_PROJECT_NAME": project}
    c = stack.compose(stack.env_file, project)
    times = stack.times
    try:
        t = time.monotonic()
        up = _make("stack-docker", stack.env_file, env, timeout=900)
        times["make stack-docker"] = time.monotonic() - t
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-3000:]
        secrets = read_env_file(stack.env_file)
        assert set(SECRETS) <= secrets.keys() and stack.env_file.stat().st_mode & 0o777 == 0o600
        ports = compose.ports(c)
        mlflow_url, prefect_api = (
            f"http://127.0.0.1:{ports['mlflow']}",
            f"http://127.0.0.1:{ports['prefect-server']}/api",
        )
        # the printed URLs, and hints for the client there is (Debian has docker-compose, no `docker compose`)
        assert f"MLflow  {mlflow_url}" in up.stdout and "run: docker-compose --env-file" in up.stdout, up.stdout
        # the dependency stage came from the cache: no index was asked for torch
        assert "Looking in indexes" not in up.stdout + up.stderr, up.stdout[-3000:]
        # every service runs as a user other than root
        for service in ("db", "mlflow", "prefect-server", "worker"):
            uid = c.run("exec", "-T", service, "id", "-u").stdout.strip()
            assert uid not in ("", "0"), service
        # only the two UIs are published, on loopback
        published = stack.daemon.docker(
            "ps", "--format", "{{.Ports}}", "--filter", f"label=com.docker.compose.project={project}"
        ).stdout
        assert sorted(p for p in published.replace(",", " ").split() if "->" in p) == sorted(
            f"127.0.0.1:{ports[s]}->{port}/tcp" for s, port in (("mlflow", 5000), ("prefect-server", 4200))
        )
        # no container left exited (a failed build step's, a one-off's)
        exited = stack.daemon.docker("ps", "-aq", "--filter", "status=exited").stdout.split()
        assert not exited, stack.daemon.docker("ps", "-a").stdout

        # anonymous: 401 on both APIs; with the credentials: 200
        auth = secrets["PREFECT_AUTH_STRING"]
        assert _request(f"{prefect_api}/work_pools/difflm") == 401
        assert _request(f"{prefect_api}/work_pools/difflm", auth) == 200
        search = f"{mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1"
        assert _request(search) == 401
        assert _request(search, f"{MLFLOW_ADMIN}:{secrets['MLFLOW_ADMIN_PASSWORD']}") == 200
        # the deployments are registered, the nightly one with its schedule paused
        nightly = urllib.parse.quote("pretrain-difflm/nightly-end-to-end")
        status, body = _get(f"{prefect_api}/deployments/name/{nightly}", auth)
        assert status == 200, status
        schedules = json.loads(body)["schedules"]
        assert schedules and not any(s["active"] for s in schedules), schedules

        # the documented run, in the worker container (the test-tiny preset: --params)
        scenario = SCENARIOS["docker"]
        argv = ["exec", "-T", "worker", "prefect", "deployment", "run", scenario.deployment, "--watch"]
        argv += ["--watch-timeout", "400", "--params", json.dumps(scenario.params(Path(WORKDIR)))]
        t = time.monotonic()
        run = _documented(["docker-compose", "--env-file", str(stack.env_file), *argv], env, timeout=450)
        times["run"] = time.monotonic() - t
        worker_log = c.run("logs", "--no-color", "--tail", "80", "worker", check=False).stdout
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:] + worker_log[-4000:]
        assert "Flow run finished successfully in 'Completed'" in run.stdout, run.stdout[-3000:]

        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", MLFLOW_ADMIN)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", secrets["MLFLOW_ADMIN_PASSWORD"])
        client = MlflowClient(mlflow_url)

        def finished() -> tuple:
            experiments = [e.experiment_id for e in client.search_experiments()]
            (parent,) = client.search_runs(experiments, "tags.flow = 'pretrain-difflm'")
            losses = [m.value for m in client.get_metric_history(parent.info.run_id, "loss")]
            (mv,) = client.search_model_versions(f"run_id = '{parent.info.run_id}'")
            return parent.info.run_id, parent.info.status, tuple(losses), mv.name, mv.version

        before = finished()
        assert before[1] == "FINISHED" and len(before[2]) > 0, before

        # down keeps the volumes; make stack-docker again (the build all cached) finds the run, metrics and version
        down = _documented(["python3", "-m", "deploy.compose", "down", "--env-file", str(stack.env_file)], env, 120)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not c.containers()
        t = time.monotonic()
        again = _make("stack-docker", stack.env_file, env, timeout=600)
        times["make stack-docker again"] = time.monotonic() - t
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert finished() == before
    finally:
        _down(c, volumes=True)
    assert not stack.daemon.docker("volume", "ls", "-q", "--filter", f"name={project}").stdout.strip()


def _project(stack: Stack, tmp_path: Path, name: str) -> compose.Compose:
    """docker-compose.yml of this checkout as project `name`, its env file in tmp_path at free ports."""
    mlflow_port, prefect_port = free_ports(2)
    env_file = tmp_path / f"{name}.env"
    env_file.write_text(f"MLFLOW_PORT={mlflow_port}\nPREFECT_PORT={prefect_port}\n")
    env = {**stack.env, "DIFFLM_BASE_IMAGE": docker_local.PYTHON_BASE, "DIFFLM_POSTGRES_IMAGE": docker_local.POSTGRES}
    c = stack.compose(env_file, name)
    c.env.update(env)
    return c


def test_bad_input_gets_one_line_and_changes_nothing(stack, tmp_path):
    c = _project(stack, tmp_path, f"difflmbad{os.getpid()}")
    try:
        # a missing secret: compose itself refuses, naming the file to fill
        c.env_file.write_text(c.env_file.read_text() + "POSTGRES_PASSWORD=x\n")
        done = c.run("config", "-q", check=False)
        assert done.returncode != 0 and "set in .env, see deploy/stack.env.example" in done.stderr, done.stderr
        # an empty one: refused before anything starts
        c.env_file.write_text(c.env_file.read_text().replace("POSTGRES_PASSWORD=x", "POSTGRES_PASSWORD="))
        with pytest.raises(compose.ComposeError, match=r"^POSTGRES_PASSWORD empty in .*: delete the line"):
            compose.up(c, build=False)
        assert not c.containers()
        # a published port already taken
        c.env_file.write_text(c.env_file.read_text().replace("POSTGRES_PASSWORD=\n", ""))
        ensure_secrets(c.env_file, read_env_file(c.env_file))
        port = compose.ports(c)["mlflow"]
        with socket.socket() as held:
            held.bind(("127.0.0.1", port))
            held.listen()
            with pytest.raises(compose.ComposeError, match=rf"^port {port} on 127.0.0.1 is taken .*MLFLOW_PORT="):
                compose.up(c, build=False)
        assert not c.containers()
        # a database volume from an older PostgreSQL: one line, the volume untouched
        volume = f"{c.env['COMPOSE_PROJECT_NAME']}_db"
        stack.daemon.docker(
            "volume",
            "create",
            "--label",
            f"com.docker.compose.project={c.env['COMPOSE_PROJECT_NAME']}",
            "--label",
            "com.docker.compose.volume=db",
            volume,
        )
        write = "initdb -D $PGDATA -U postgres >/dev/null && echo 14 > $PGDATA/PG_VERSION"  # a cluster of PostgreSQL 14
        stack.daemon.docker(
            "run",
            "--rm",
            "-v",
            f"{volume}:/var/lib/postgresql/data",
            "--entrypoint",
            "sh",
            docker_local.POSTGRES,
            "-c",
            write,
        )
        with pytest.raises(compose.ComposeError, match=r"holds a PostgreSQL 14 cluster and this image runs 15"):
            compose.up(c, build=False, timeout=120)
        assert not c.containers()  # refused before anything started
        kept = stack.daemon.docker(
            "run", "--rm", "-v", f"{volume}:/v", "--entrypoint", "cat", docker_local.POSTGRES, "/v/PG_VERSION"
        ).stdout
        assert kept.strip() == "14"
    finally:
        _down(c, volumes=True)
