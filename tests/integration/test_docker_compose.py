"""docker-compose.yml on a real Docker engine: a private dockerd (deploy/docker_local.py: its own socket, exec root
and pid file in a temp folder, its images in a cache folder so the bases built without a registry are reused),
Debian's clients (/usr/bin/docker, /usr/bin/docker-compose) with DOCKER_HOST at its socket. The pipeline image is
built on a local Python 3.11 base and PostgreSQL from Debian's package (no registry answers here); `python -m
deploy.compose up` brings the stack up healthy and registers the deployments; the test-tiny run goes through the
Prefect API with the auth string, MLflow (with credentials; anonymous gets 401) holds its run, metrics and
registered version, and after `down` and `up` again they are all still there. Bad input (an empty or missing
secret, a port already taken, a database volume of an older PostgreSQL) gets one line and changes nothing. The
test's containers, volumes and pipeline image are removed; the bases and the dependency and runtime stages stay
cached (~/.cache/difflm/docker).

`make test` installs the engine when root (`make docker`); without it the tests are skipped with the reason (under
CI: failed). The cached images are built in the background from the start of the session (tests/support/
docker_prebuild.py: about 6 minutes on a fresh host), so the fixture builds only the project's own layers."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import docker_prebuild
import pytest
from conftest import skip_or_fail
from mlflow.tracking import MlflowClient
from scenarios import SCENARIOS
from servers import free_ports

from deploy import compose, docker_local
from deploy.env_file import MLFLOW_ADMIN, ensure_secrets, read_env_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
IMAGE = "difflm-pipeline:latest"
WORKDIR = "/data/difflm-test"  # in the worker's workdir volume


@pytest.fixture(scope="module")
def engine():
    """The private daemon with the bases and the pipeline image built; the image goes at the end, the daemon stops."""
    why = docker_local.unavailable()
    if why:
        skip_or_fail(why)
    t = time.monotonic()
    print(docker_prebuild.wait())  # the daemon below shares its data root: one at a time
    times = {"waited for the background build": time.monotonic() - t}
    root = Path(tempfile.mkdtemp(prefix="dkr-", dir="/tmp"))  # short: a unix socket path has 107 bytes at most
    try:
        d = docker_local.start(root)
    except docker_local.DockerUnavailable as err:
        shutil.rmtree(root, ignore_errors=True)
        skip_or_fail(f"the private dockerd did not start: {err}")
    try:
        t = time.monotonic()
        docker_local.ensure_bases(d, echo=print)
        times["bases"] = time.monotonic() - t
        docker_local.build_pipeline(d, IMAGE, echo=print)
        times["image"] = time.monotonic() - t - times["bases"]
        d.times = times  # type: ignore[attr-defined]
        yield d
    finally:
        d.docker("rmi", "-f", IMAGE, check=False)
        d.docker("image", "prune", "-f", check=False)  # the dangling layers of this build, not the tagged caches
        docker_local.stop(d)
        shutil.rmtree(root, ignore_errors=True)
        print("docker test times (s):", {k: round(v, 1) for k, v in times.items()})


def _project(d: docker_local.Daemon, tmp_path: Path, name: str) -> compose.Compose:
    """docker-compose.yml of this checkout as project `name`, its env file in tmp_path at free ports."""
    mlflow_port, prefect_port = free_ports(2)
    env_file = tmp_path / f"{name}.env"
    env_file.write_text(f"MLFLOW_PORT={mlflow_port}\nPREFECT_PORT={prefect_port}\n")
    env = {
        **d.env,
        "COMPOSE_PROJECT_NAME": name,
        "DIFFLM_DOCKER": docker_local.DOCKER,
        "DIFFLM_BASE_IMAGE": docker_local.PYTHON_BASE,
        "DIFFLM_POSTGRES_IMAGE": docker_local.POSTGRES,
    }
    return compose.Compose(env_file, ROOT, [docker_local.COMPOSE], env)


def _request(url: str, auth: str | None = None) -> int:
    h = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=h), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def _down(c: compose.Compose, volumes: bool) -> None:
    c.run("down", *(["-v"] if volumes else []), "--remove-orphans", timeout=120)


@pytest.mark.slow(
    reason="docker-compose.yml on a private engine: the images built, the stack up, a flow run, down and up"
)
def test_compose_runs_the_pipeline_and_keeps_it_across_down_and_up(engine, tmp_path, monkeypatch):
    c = _project(engine, tmp_path, f"difflmtest{os.getpid()}")
    times = engine.times
    try:
        t = time.monotonic()
        ports = compose.up(c, build=False, timeout=400)
        times["up"] = time.monotonic() - t
        secrets = read_env_file(c.env_file)
        assert c.env_file.stat().st_mode & 0o777 == 0o600
        mlflow_url, prefect_api = (
            f"http://127.0.0.1:{ports['mlflow']}",
            f"http://127.0.0.1:{ports['prefect-server']}/api",
        )
        # every service runs as a user other than root
        for service in ("db", "mlflow", "prefect-server", "worker"):
            uid = c.run("exec", "-T", service, "id", "-u").stdout.strip()
            assert uid not in ("", "0"), service
        # only the two UIs are published, on loopback
        published = engine.docker(
            "ps",
            "--format",
            "{{.Ports}}",
            "--filter",
            f"label=com.docker.compose.project={c.env['COMPOSE_PROJECT_NAME']}",
        ).stdout
        assert sorted(p for p in published.replace(",", " ").split() if "->" in p) == sorted(
            f"127.0.0.1:{ports[s]}->{port}/tcp" for s, port in (("mlflow", 5000), ("prefect-server", 4200))
        )

        # anonymous: 401 on both APIs; with the credentials: 200
        auth = secrets["PREFECT_AUTH_STRING"]
        assert _request(f"{prefect_api}/work_pools/difflm") == 401
        assert _request(f"{prefect_api}/work_pools/difflm", auth) == 200
        search = f"{mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1"
        assert _request(search) == 401
        assert _request(search, f"{MLFLOW_ADMIN}:{secrets['MLFLOW_ADMIN_PASSWORD']}") == 200

        # the test-tiny run through the Prefect API (the CLI with the auth string), on the worker container
        scenario = SCENARIOS["docker"]
        client_env = {
            **os.environ,
            "PREFECT_API_URL": prefect_api,
            "PREFECT_API_AUTH_STRING": auth,
            "PREFECT_HOME": str(tmp_path / "prefect-home"),
        }
        argv = [str(BIN / "prefect"), "deployment", "run", scenario.deployment, "--watch", "--watch-timeout", "400"]
        argv += ["--params", json.dumps(scenario.params(Path(WORKDIR)))]
        t = time.monotonic()
        run = subprocess.run(argv, env=client_env, capture_output=True, text=True, timeout=450, cwd=tmp_path)
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

        # down keeps the volumes; up again (no rebuild) finds the run, its metrics and the registered version
        _down(c, volumes=False)
        assert not c.containers()
        t = time.monotonic()
        compose.up(c, build=False, timeout=400)
        times["up again"] = time.monotonic() - t
        assert finished() == before
    finally:
        _down(c, volumes=True)
    assert not engine.docker("volume", "ls", "-q", "--filter", f"name={c.env['COMPOSE_PROJECT_NAME']}").stdout.strip()


def test_bad_input_gets_one_line_and_changes_nothing(engine, tmp_path):
    c = _project(engine, tmp_path, f"difflmbad{os.getpid()}")
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
        engine.docker(
            "volume",
            "create",
            "--label",
            f"com.docker.compose.project={c.env['COMPOSE_PROJECT_NAME']}",
            "--label",
            "com.docker.compose.volume=db",
            volume,
        )
        write = "initdb -D $PGDATA -U postgres >/dev/null && echo 14 > $PGDATA/PG_VERSION"  # a cluster of PostgreSQL 14
        engine.docker(
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
        kept = engine.docker(
            "run", "--rm", "-v", f"{volume}:/v", "--entrypoint", "cat", docker_local.POSTGRES, "/v/PG_VERSION"
        ).stdout
        assert kept.strip() == "14"
    finally:
        _down(c, volumes=True)
