"""`pretrain-difflm` as a Prefect deployment: a real `prefect server` on 127.0.0.1, `difflm serve`,
and `prefect deployment run 'pretrain-difflm/...' --watch`, as the README tells users; and every deployment of
prefect.yaml read the way `prefect deploy` reads it."""

import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from prefect.cli.deploy._models import PrefectYamlModel
from prefect.cli.deploy._schedules import _schedule_config_to_deployment_schedule
from prefect.client.schemas.schedules import IntervalSchedule
from scenarios import SCENARIOS
from servers import BIN, stop

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = SCENARIOS["serve"]  # `difflm serve pretrain-difflm` with the scenario's overrides
NAME = SCENARIO.deployment.split("/")[1]


@pytest.mark.slow(
    reason="`difflm serve` and two whole pipeline runs through `prefect deployment run`, then `prefect deploy --all`"
)
def test_deployment_run_from_the_cli(tmp_path, prefect_server):
    # Prefect's task results (its cache) in a folder of their own
    server = prefect_server(PREFECT_LOCAL_STORAGE_PATH=str(tmp_path / "results"))
    env = server.env
    serve = None
    try:
        workdir = tmp_path / "work"
        serve = subprocess.Popen(
            [str(BIN / "difflm"), "serve", "pretrain-difflm", "--preset", SCENARIO.preset, "--name", NAME]
            + SCENARIO.dotlist(workdir),
            env=env,
            stdout=(tmp_path / "serve.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        deadline, out = time.time() + 60, None
        while time.time() < deadline:  # wait until `serve` has registered the deployment
            out = subprocess.run([str(BIN / "prefect"), "deployment", "ls"], env=env, capture_output=True, text=True)
            if SCENARIO.deployment in out.stdout:
                break
            time.sleep(1)
        assert out is not None and SCENARIO.deployment in out.stdout, out.stdout if out else None
        run = subprocess.run(
            [str(BIN / "prefect"), "deployment", "run", SCENARIO.deployment, "--watch", "--watch-timeout", "400"],
            env=env,
            capture_output=True,
            text=True,
            timeout=450,
        )
        assert run.returncode == 0, run.stdout + run.stderr + (tmp_path / "serve.log").read_text()[-5000:]
        assert "Completed" in run.stdout
        SCENARIO.check(workdir)

        # a second run of the deployment reuses every stage, the evaluation included, and says so, also when
        # Prefect's cache is elsewhere (a worker on another host, a wiped PREFECT_HOME): tried as a new user
        # would, every run evaluated again (3 minutes) and labelled every stage "ran"
        assert (tmp_path / "results").is_dir()
        shutil.rmtree(tmp_path / "results")
        (results,) = workdir.glob("runs/*/eval/results.json")
        before, logged = results.stat().st_mtime_ns, len((tmp_path / "serve.log").read_text())
        again = subprocess.run(
            [str(BIN / "prefect"), "deployment", "run", SCENARIO.deployment, "--watch", "--watch-timeout", "400"],
            env=env,
            capture_output=True,
            text=True,
            timeout=450,
        )
        assert again.returncode == 0 and "Completed" in again.stdout, again.stdout + again.stderr
        second = (tmp_path / "serve.log").read_text()[logged:]
        finished = re.search(r"pretrain-difflm finished \(([^)]*)\)", second)
        assert finished and "ran" not in finished.group(1), second[-3000:]
        assert results.stat().st_mtime_ns == before  # not evaluated again

        # prefect.yaml's deployments for the work pool register on the same server, as the README says
        pool = subprocess.run(
            [str(BIN / "prefect"), "work-pool", "create", "difflm", "--type", "process"],
            env=env,
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert pool.returncode == 0, pool.stdout + pool.stderr
        deploy = subprocess.run(
            [str(BIN / "prefect"), "--no-prompt", "deploy", "--all"],
            env=env,
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        listed = subprocess.run(
            [str(BIN / "prefect"), "deployment", "inspect", "evaluate-latest/every-10-minutes", "--output", "json"],
            env=env,
            capture_output=True,
            text=True,
        )
        scheduled = json.loads(listed.stdout)
        assert [s["schedule"]["interval"] for s in scheduled["schedules"]] == [600.0]
        assert scheduled["global_concurrency_limit"]["limit"] == 1
    finally:
        if serve:
            stop(serve)


def test_prefect_yaml_deployments_load_and_validate():
    """What `prefect deploy --all` needs from each entry, without a server: the file parses with Prefect's own
    model, every entrypoint loads a flow whose parameter schema accepts the entry's parameters, and every
    schedule becomes a Prefect schedule."""
    raw = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    model = PrefectYamlModel.model_validate(raw)
    flows = {}
    for dep, entry in zip(model.deployments, raw["deployments"]):
        # module entrypoints only: a file path (flows/x.py:f) makes a worker put flows/ first on sys.path, where
        # flows/data_prep.py shadows the data_prep package (test_production_stack loads them as a worker does)
        module, name = dep.entrypoint.split(":")
        assert "/" not in module and (ROOT / (module.replace(".", "/") + ".py")).exists(), dep.entrypoint
        fl = getattr(importlib.import_module(module), name)
        fl.validate_parameters(dep.parameters)  # raises on a parameter the flow does not take or a wrong type
        flows[f"{fl.name}/{dep.name}"] = [
            _schedule_config_to_deployment_schedule(s) for s in entry.get("schedules", [])
        ]
        assert dep.work_pool and dep.work_pool.name == "difflm"
    assert {
        "pretrain-difflm/tiny-cpu",
        "pretrain-difflm/nightly-end-to-end",
        "pretrain-difflm/slurm",
        "pretrain-difflm/kubernetes",
        "convert-checkpoint/convert",
        "evaluate-latest/every-10-minutes",
        "sft-difflm/sft-tiny",
    } <= flows.keys()
    (every,) = flows["evaluate-latest/every-10-minutes"]
    assert isinstance(every["schedule"], IntervalSchedule) and every["schedule"].interval.total_seconds() == 600


@pytest.mark.slow
def test_serve_stops_within_seconds_on_ctrl_c_after_its_server_stopped(tmp_path, prefect_server):
    """Tried as a new user would: with the Prefect server gone first, Ctrl-C on `difflm serve` hung for over a
    minute and ended in a traceback. Now: one line and exit 130 within the grace period."""
    server = prefect_server()
    env = server.env
    serve = None
    try:
        serve = subprocess.Popen(
            [str(BIN / "difflm"), "serve", "pretrain-difflm", "--preset", "test-tiny", "--name", "stop"]
            + [f"workdir={tmp_path / 'work'}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own group: the SIGINT below reaches it alone, as a terminal's would
        )
        deadline = time.time() + 90
        while time.time() < deadline:  # registered: the runner is polling its server
            out = subprocess.run([str(BIN / "prefect"), "deployment", "ls"], env=env, capture_output=True, text=True)
            if "pretrain-difflm/stop" in out.stdout:
                break
            time.sleep(1)
        server.stop()
        time.sleep(3)
        t0 = time.time()
        os.killpg(serve.pid, signal.SIGINT)
        _, err = serve.communicate(timeout=120)
        took = time.time() - t0
        last = err.strip().splitlines()[-1]
        assert serve.returncode == 130 and last.startswith("difflm: serve stopped"), err[-3000:]
        assert took < 40, took  # the grace period (10 s) and some slack for a loaded machine
    finally:
        if serve and serve.poll() is None:
            serve.kill()
