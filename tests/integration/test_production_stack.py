"""The production stack of docker-compose.yml (issue #11), run for real without Docker.

Fast: docker-compose.yml runs exactly the commands and environments `deploy.stack.services(compose_stack())`
gives (the native start uses the same function, so the two cannot drift), publishes ports on 127.0.0.1 only,
and no secret is in the repository. Slow: `deploy.stack.up` starts PostgreSQL, the MLflow server on it (served
artifacts), the Prefect server on it and a process worker on 127.0.0.1, free ports, fresh secrets; `prefect deploy`
registers `pretrain-difflm/local`, `prefect deployment run ... --watch` runs it on the test preset through the
worker, and MLflow (over HTTP and in its PostgreSQL tables) holds the finished run, its stage runs, its dataset
input and a registered version with alias `candidate`; the artifacts are in the stack's artifact folder. The
stack is stopped in any case, and no process of it may be left.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg2
import pytest
import yaml
from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
from scenarios import SCENARIOS, Scenario
from servers import free_ports

from deploy import env_file, stack
from difflm.data_prep.corpus import cache_dir
from difflm.outputs import private_umask

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PLACEHOLDER = "${{{}:?set in .env, see deploy/stack.env.example}}"


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_compose_runs_the_services_of_difflm_stack():
    compose, want = _compose(), stack.services(stack.compose_stack())
    assert {n for n, svc in compose.items() if "profiles" not in svc} == {"db", *want}
    for name, svc in want.items():
        got = compose[name]
        assert got["command"] == svc.argv, name
        assert {k: str(v) for k, v in got["environment"].items()} == svc.env, name
        assert got["image"] == "difflm-pipeline:latest", name
        # the torch index: the Dockerfile's default unless .env names the one the cached dependency stage used
        args = {
            "BASE_IMAGE": "${DIFFLM_BASE_IMAGE:-python:3.11-slim}",
            "TORCH_INDEX_URL": "${DIFFLM_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}",
        }
        assert got["build"] == {"context": ".", "args": args}
    # the GPU worker (profile gpu) is the worker on another image, with the NVIDIA devices
    gpu = compose["worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["command"] == want["worker"].argv
    assert {k: str(v) for k, v in gpu["environment"].items()} == want["worker"].env
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"

    s = stack.compose_stack()
    db = compose["db"]
    assert db["image"] == "${DIFFLM_POSTGRES_IMAGE:-postgres:15}" and db["user"] == "postgres"  # not root
    assert s.secrets == {k: PLACEHOLDER.format(k) for k in stack.SECRETS}
    assert db["environment"] == {k: PLACEHOLDER.format(k) for k in env_file.DB_SECRETS}
    init = [v for v in db["volumes"] if v.startswith("./deploy/postgres-init.sh:/docker-entrypoint-initdb.d/")]
    assert len(init) == 1 and init[0].endswith(".sh:ro")
    assert os.access(stack.INIT_SCRIPT, os.X_OK)  # the image's entrypoint runs an executable script, else sources it
    assert s.db_host == "db" and s.mlflow_host == "mlflow" and s.prefect_host == "prefect-server"

    # published on the loopback interface only, at the ports the services listen on; the database not at all
    assert "ports" not in db and "ports" not in compose["worker"]
    assert compose["mlflow"]["ports"] == [f"127.0.0.1:${{MLFLOW_PORT:-{s.mlflow_port}}}:{s.mlflow_port}"]
    assert compose["prefect-server"]["ports"] == [f"127.0.0.1:${{PREFECT_PORT:-{s.prefect_port}}}:{s.prefect_port}"]
    # the volumes hold what the services write
    assert f"mlartifacts:{s.artifacts}" in compose["mlflow"]["volumes"]
    assert any(s.cache.startswith(v.split(":")[1] + "/") for v in compose["worker"]["volumes"])
    # started in order, each when what it needs is healthy
    for name in ("db", "mlflow", "prefect-server"):
        assert compose[name]["healthcheck"]["test"], name
    assert (
        compose["mlflow"]["depends_on"]
        == compose["prefect-server"]["depends_on"]
        == {"db": {"condition": "service_healthy"}}
    )
    assert compose["worker"]["depends_on"] == {
        "prefect-server": {"condition": "service_healthy"},
        "mlflow": {"condition": "service_healthy"},
    }
    # the image's ENV is what a native start gives every service
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    final_stage = dockerfile.split(" AS runtime\n", 1)[1]  # the runtime and project stages: what the services run with
    env_lines = [line for line in final_stage.splitlines() if line.startswith("ENV ")]
    image_env = dict(kv.split("=", 1) for line in env_lines for kv in line.split()[1:])
    assert stack.IMAGE_ENV.items() <= image_env.items()


def _repository_files() -> list[Path]:
    """What git would commit: tracked files and untracked ones that are not ignored."""
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [ROOT / f for f in out.split("\0") if f and (ROOT / f).is_file()]


@pytest.mark.integration  # git
def test_no_secrets_in_the_repository():
    for ignored in (".env", ".difflm-stack/"):
        assert subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", ignored]).returncode == 0, ignored
    example = stack.read_env_file(ROOT / "deploy" / "stack.env.example")
    assert set(example) == set(stack.SECRETS) and not any(example.values())  # empty: compose refuses to start

    credentials = re.compile(r"\b[a-z][a-z0-9+.-]*://[\w.-]+:([^\s/@'\"]+)@")  # a password in a URL
    assignment = re.compile(r"\b(\w*PASSWORD\w*)[\"']?[ \t]*(?:=|:\s)[ \t]*[\"']?([^\s\"',;#)]+)")  # K=v, K: v
    local = {
        v
        for k, v in (stack.read_env_file(ROOT / ".env").items() if (ROOT / ".env").exists() else [])
        if k in stack.SECRETS and len(v) >= 8
    }
    found = []
    for path in _repository_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        rel = path.relative_to(ROOT)
        found += [
            f"{rel}: url password {m.group(1)}"
            for m in credentials.finditer(text)
            if not m.group(1).startswith(("${", "{", "<", "$"))
        ]
        found += [
            f"{rel}: {m.group(1)}={m.group(2)}"
            for m in assignment.finditer(text)  # in configuration files
            if path.suffix != ".py" and not m.group(2).startswith(("${", "{", "<", "$", "change-me"))
        ]
        found += [f"{rel}: a value of .env" for v in local if v in text]
    assert not found, found


@pytest.mark.integration  # a fresh interpreter per entrypoint
def test_prefect_yaml_entrypoints_load_as_a_worker_loads_them():
    """A worker's flow run imports the entrypoint with Prefect's `import_object`, in the project root: a script
    path (`flows/x.py:f`) puts flows/ first on sys.path, where flows/data_prep.py shadows the data_prep package;
    a module path (`flows.x:f`) does not. Each in a fresh interpreter, as in a flow run."""
    entrypoints = sorted({d["entrypoint"] for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]})
    code = "import sys; from prefect.utilities.importtools import import_object; import_object(sys.argv[1])"
    procs = {
        ep: subprocess.Popen(
            [sys.executable, "-c", code, ep], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for ep in entrypoints
    }
    failed = {ep: p.communicate(timeout=120)[0].strip().splitlines()[-1:] for ep, p in procs.items()}
    assert not {ep: out for ep, out in failed.items() if procs[ep].returncode}, (
        "use module entrypoints in prefect.yaml (difflm.flows.pretrain:pretrain_difflm)"
    )


def test_up_refuses_missing_or_template_secrets(tmp_path):
    with pytest.raises(SystemExit, match="missing"):
        stack.up(tmp_path, {"POSTGRES_PASSWORD": "x"})
    with pytest.raises(SystemExit, match="missing"):
        stack.up(tmp_path, stack.read_env_file(ROOT / "deploy" / "stack.env.example"))
    with pytest.raises(SystemExit, match="change-me"):
        stack.up(tmp_path, {**env_file.generate_secrets(), "POSTGRES_PASSWORD": "change-me-postgres"})
    assert not (tmp_path / "pg").exists()


def test_secrets_are_generated_into_a_private_env_file(tmp_path):
    env = tmp_path / ".env"
    shutil.copy(ROOT / "deploy" / "stack.env.example", env)
    os.chmod(env, 0o644)
    assert stack.main(["secrets", "--env-file", str(env)]) == 0
    values = stack.read_env_file(env)
    assert all(len(values[k]) >= 48 for k in stack.SECRETS) and values["PREFECT_AUTH_STRING"].startswith("admin:")
    assert env.stat().st_mode & 0o777 == 0o600
    stack.main(["secrets", "--env-file", str(env)])
    assert stack.read_env_file(env) == values  # kept, not regenerated
    with pytest.raises(SystemExit, match="change-me"):
        stack.ensure_secrets(env, {**values, "MLFLOW_DB_PASSWORD": "change-me-mlflow"})


@pytest.mark.integration  # runs the stack's start-up commands
def test_failed_up_leaves_no_readable_password_file(tmp_path, monkeypatch):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "initdb").write_text("#!/bin/sh\nexit 1\n")  # initdb failing after the password file is written
    os.chmod(fake / "initdb", 0o755)
    monkeypatch.setenv("PG_BIN", str(fake))
    monkeypatch.setattr(stack, "_db_user_owns", lambda path: None)
    state = tmp_path / "stack"
    with pytest.raises(subprocess.CalledProcessError):
        stack.up(state, env_file.generate_secrets())
    assert not (state / "pg" / "pwfile").exists()


@pytest.mark.integration  # a stray process to spare
def test_down_never_signals_a_process_it_did_not_start(tmp_path):
    state = tmp_path / "stack"
    state.mkdir()
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # not the stack's: a reused pid
    try:
        (state / "pids.json").write_text(json.dumps({"worker": other.pid}))  # a stale record of the old format
        assert stack.down(state, grace=1) == []
        start = stack._start_time(other.pid)
        (state / "pids.json").write_text(json.dumps({"worker": {"pid": other.pid, "start": start - 1}}))
        assert stack.down(state, grace=1) == []
        assert other.poll() is None  # still running
        (state / "pids.json").write_text(json.dumps({"worker": {"pid": other.pid, "start": start}}))
        assert stack.down(state, grace=5) == ["worker"]  # the recorded process itself is stopped
        assert other.wait(timeout=10) is not None
    finally:
        other.kill()


# ----- the stack, started for real -----------------------------------------------------------------------------


def _postgres_or_skip() -> None:
    try:
        stack._pg_bin()
    except SystemExit as missing:
        why = f"{missing} (Debian: apt-get install postgresql)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the production stack test: {why}")
        pytest.skip(why)


def _left_behind(state: Path, pids: dict[str, int]) -> list[str]:
    """Processes of the stack still there: marked ones (services and every child, flow runs included) and members
    of the services' sessions (PostgreSQL's backends overwrite their environment with their status line)."""
    sessions = {str(p) for p in pids.values()}
    left = set(stack.stack_processes(state))
    for d in Path("/proc").glob("[0-9]*"):
        st = stack._stat(d.name)
        if len(st) > 3 and st[0] != "Z" and (st[2] in sessions or st[3] in sessions):
            left.add(int(d.name))
    out = []
    for pid in sorted(left):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{pid}: {cmd[:200]}")
        except OSError:
            pass
    return out


def _sh(argv: list[str], env: dict, timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def _request(url: str, auth: str | None = None, method: str = "GET", headers: dict | None = None, data=None):
    h = {**(headers or {}), **({"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {})}
    return urllib.request.Request(url, method=method, headers=h, data=data)


def _status(req: urllib.request.Request) -> int:
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def _secured(prefect_api: str, mlflow_url: str, pw: dict) -> None:
    """The review's reproductions against the stack: no anonymous API, no cross-site requests."""
    auth = pw["PREFECT_AUTH_STRING"]
    body = json.dumps({"name": "evil", "flow_id": "00000000-0000-0000-0000-000000000000"}).encode()
    json_h = {"Content-Type": "application/json"}
    # anonymous Prefect: 401 (registering a deployment with a shell pull step included); health stays open
    assert _status(_request(f"{prefect_api}/work_pools/{stack.WORK_POOL}")) == 401
    # (a POST without a CSRF token is refused first: 403)
    assert _status(_request(f"{prefect_api}/deployments/", method="POST", headers=json_h, data=body)) in (401, 403)
    assert _status(_request(f"{prefect_api}/health")) == 200
    assert _status(_request(f"{prefect_api}/work_pools/{stack.WORK_POOL}", auth)) == 200
    # with the credentials but without a CSRF token (a browser tricked into a request): 403
    assert _status(_request(f"{prefect_api}/flows/filter", auth, "POST", json_h, b"{}")) == 403
    # a foreign origin gets no CORS grant
    pre = _request(
        f"{prefect_api}/flows/filter",
        method="OPTIONS",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
    )
    try:
        with urllib.request.urlopen(pre, timeout=10) as r:
            allowed = r.headers.get("access-control-allow-origin")
    except urllib.error.HTTPError as err:
        allowed = err.headers.get("access-control-allow-origin")
    assert allowed in (None, "") or allowed != "*" and "evil" not in allowed
    # anonymous MLflow: 401, an artifact upload too; the admin gets in
    admin = f"admin:{pw['MLFLOW_ADMIN_PASSWORD']}"
    search = f"{mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1"
    assert _status(_request(search)) == 401
    put = f"{mlflow_url}/api/2.0/mlflow-artifacts/artifacts/0/evil/modeling_difflm.py"
    assert _status(_request(put, method="PUT", data=b"import os")) == 401
    assert _status(_request(search, admin)) == 200
    assert _status(_request(search, "admin:wrong")) == 401


@dataclass
class StackRun:
    """The stack, started once for the module, and the one run of its `pretrain-difflm/local` deployment."""

    base: Path
    state: Path
    workdir: Path
    secrets: dict[str, str]
    db_port: int
    mlflow_url: str
    prefect_api: str
    client_env: dict[str, str]  # what `up` wrote to client.env
    times: dict[str, float] = field(default_factory=dict)
    left_behind: list[str] | None = None  # set by stop()

    def stop(self) -> list[str]:
        """`down`, once: the processes of the stack still there after it."""
        if self.left_behind is None:
            pids = stack._pids(self.state)
            t = time.time()
            stack.down(self.state)
            self.times["down"] = time.time() - t
            self.left_behind = _left_behind(self.state, pids)
            print("production stack times (s):", {k: round(v, 1) for k, v in self.times.items()})
        return self.left_behind

    def mlflow(self) -> MlflowClient:
        return MlflowClient(self.mlflow_url)

    def pipeline_run(self) -> Run:
        """The deployment's MLflow run (the flow's parent run)."""
        client = self.mlflow()
        (parent,) = client.search_runs(
            [e.experiment_id for e in client.search_experiments()], "tags.flow = 'pretrain-difflm'"
        )
        return parent

    def query(self, db: str, sql: str, *args) -> list[tuple]:
        """A query on the service's own PostgreSQL database, as its user."""
        with (
            psycopg2.connect(
                host="127.0.0.1",
                port=self.db_port,
                user=db,
                dbname=db,
                password=self.secrets[f"{db.upper()}_DB_PASSWORD"],
            ) as conn,
            conn.cursor() as cur,
        ):
            cur.execute(sql, args)
            return cur.fetchall()


def _deployment_run(scenario: Scenario, workdir: Path, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    params = json.dumps(scenario.params(workdir))
    argv = [str(BIN / "prefect"), "deployment", "run", scenario.deployment, "--params", params, "--watch"]
    return _sh([*argv, "--watch-timeout", "400"], env, 450, cwd=cwd)


@pytest.fixture(scope="module")
def stack_run() -> Iterator[StackRun]:
    """`up` (PostgreSQL, MLflow, Prefect and a worker on free ports, fresh secrets), `prefect deploy` and one run
    of the deployment on the test preset; the tests below each check one property of it, the last that `down`
    leaves no process. Stopped in any case."""
    _postgres_or_skip()
    # PostgreSQL runs as its own user (we may be root): its folder must be reachable, which pytest's 0700
    # basetemp is not
    base = Path(tempfile.mkdtemp(prefix="difflm-stack-test-"))
    os.chmod(base, 0o755)
    db_port, mlflow_port, prefect_port = free_ports(3)
    run = StackRun(
        base=base,
        state=base / "stack",
        workdir=base / "work",
        secrets=env_file.generate_secrets(),
        db_port=db_port,
        mlflow_url=f"http://127.0.0.1:{mlflow_port}",
        prefect_api=f"http://127.0.0.1:{prefect_port}/api",
        client_env={},
    )
    t0 = time.time()
    try:
        with private_umask():  # as `python -m deploy.stack up` runs it: the database user must still reach pg/
            stack.up(
                run.state,
                run.secrets,
                db_port=db_port,
                mlflow_port=mlflow_port,
                prefect_port=prefect_port,
                cache=cache_dir(),
            )  # the corpus the suite already fetched, not a new download
        run.times["up"] = time.time() - t0
        client = stack.read_env_file(run.state / "client.env")
        run.client_env = {k.removeprefix("export "): v for k, v in client.items()}
        env = {**os.environ, **run.client_env, "PREFECT_HOME": str(base / "cli-home"), "PWD": str(ROOT)}
        # (`{{ $PWD }}`: where the code is)
        with pytest.MonkeyPatch.context() as mp:  # the MLflow clients of the tests log in as the stack's user
            for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
                mp.setenv(k, run.client_env[k])
            t = time.time()
            deploy = _sh([str(BIN / "prefect"), "--no-prompt", "deploy", "--name", "local"], env, 180, cwd=ROOT)
            assert deploy.returncode == 0, deploy.stdout + deploy.stderr
            run.times["deploy"] = time.time() - t

            t = time.time()
            done = _deployment_run(SCENARIOS["stack"], run.workdir, env, base)
            run.times["flow run"] = time.time() - t
            logs = "".join(
                f"\n--- {f.name}\n" + f.read_text()[-4000:] for f in sorted((run.state / "logs").glob("*.log"))
            )
            assert done.returncode == 0 and "Completed" in done.stdout, done.stdout + done.stderr + logs
            yield run
    finally:
        run.stop()
        print(f"production stack: {time.time() - t0:.0f} s in all")
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow(
    reason="pays for the module's stack: PostgreSQL, MLflow, Prefect and a worker started, deploy, one flow run"
)
def test_the_run_leaves_what_its_scenario_expects(stack_run):
    SCENARIOS["stack"].check(stack_run.workdir)


@pytest.mark.slow
def test_the_stack_keeps_its_files_private_and_tells_clients_where_it_is(stack_run):
    assert not (stack_run.state / "mlartifacts").stat().st_mode & 0o077  # the services' files are not for others
    assert (stack_run.state / "client.env").stat().st_mode & 0o777 == 0o600
    assert stack_run.client_env["PREFECT_API_URL"] == stack_run.prefect_api


@pytest.mark.slow
def test_no_anonymous_api_and_no_cross_site_requests(stack_run):
    _secured(stack_run.prefect_api, stack_run.mlflow_url, stack_run.secrets)


@pytest.mark.slow
def test_mlflow_holds_the_finished_run_with_its_data_as_a_dataset_input(stack_run):
    parent = stack_run.pipeline_run()
    assert parent.info.status == "FINISHED"
    assert parent.data.params["workdir"] == str(stack_run.workdir)
    inputs = parent.inputs.dataset_inputs  # the prepared data, digest = its hash
    assert inputs and inputs[0].dataset.digest == parent.data.tags["data.hash"]


@pytest.mark.slow
def test_the_run_registers_a_version_with_alias_candidate(stack_run):
    client, rid = stack_run.mlflow(), stack_run.pipeline_run().info.run_id
    (mv,) = client.search_model_versions(f"run_id = '{rid}'")
    assert "candidate" in client.get_model_version(mv.name, mv.version).aliases
    assert client.get_model_version_by_alias(mv.name, "candidate").version == mv.version


@pytest.mark.slow
def test_artifacts_are_served_from_the_stack_folder_only(stack_run):
    parent = stack_run.pipeline_run()
    rid = parent.info.run_id
    assert parent.info.artifact_uri.startswith("mlflow-artifacts:"), parent.info.artifact_uri
    run_artifacts = stack_run.state / "mlartifacts" / parent.info.experiment_id / rid / "artifacts"
    assert (run_artifacts / "config" / "resolved.yaml").is_file()
    assert (run_artifacts / "hf_model" / "model.safetensors").is_file()
    # none beside the code or in the workdir
    assert not list(ROOT.glob(f"mlruns/*/{rid}")) and not list(stack_run.workdir.glob("**/mlflow.db"))


@pytest.mark.slow
def test_both_servers_keep_their_state_in_postgresql(stack_run):
    parent = stack_run.pipeline_run()
    assert stack_run.query("mlflow", "SELECT status FROM runs WHERE run_uuid = %s", parent.info.run_id) == [
        ("FINISHED",)
    ]
    flow_run_id = parent.data.tags["prefect.flow_run_id"]
    assert stack_run.query("prefect", "SELECT state_type FROM flow_run WHERE id = %s", flow_run_id) == [("COMPLETED",)]


@pytest.mark.slow
def test_one_nested_finished_run_per_stage(stack_run):
    parent, client = stack_run.pipeline_run(), stack_run.mlflow()
    stages = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {r.data.tags.get("stage") for r in stages} == set(SCENARIOS["stack"].stages)
    assert all(r.info.status == "FINISHED" for r in stages)


@pytest.mark.slow
def test_prefect_stage_summaries_link_the_mlflow_run_and_serve_its_figure(stack_run):
    parent = stack_run.pipeline_run()
    settings = {
        PREFECT_API_URL: stack_run.prefect_api,
        PREFECT_API_AUTH_STRING: stack_run.secrets["PREFECT_AUTH_STRING"],
    }
    flow_run = ArtifactFilterFlowRunId(any_=[parent.data.tags["prefect.flow_run_id"]])
    with temporary_settings(settings), get_client(sync_client=True) as pc:
        arts = {a.key: a for a in pc.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=flow_run))}
    assert {"data-prep-summary", "train-summary", "evaluate-summary", "train-summary-mlflow"} <= arts.keys()
    link = f"{stack_run.mlflow_url}/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}"
    assert link in arts["train-summary-mlflow"].data
    figure = re.search(r"!\[training curves\]\((\S+)\)", arts["train-summary"].data)
    assert figure, arts["train-summary"].data
    admin = f"admin:{stack_run.secrets['MLFLOW_ADMIN_PASSWORD']}"
    with urllib.request.urlopen(_request(figure[1], admin), timeout=10) as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_down_leaves_no_process_of_the_stack(stack_run):
    """(last: it stops the stack the tests above read)"""
    assert stack_run.stop() == []
