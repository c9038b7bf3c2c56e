"""`make stack-docker` (python3 -m deploy.compose up) on a fresh clone, without a Docker engine: what a new user
met (issue 51) was a traceback for the missing .env and a bare `FileNotFoundError` for the engine that was not
running. Real files, the real Debian clients when installed (else the line for a missing Docker); no engine."""

from pathlib import Path

import yaml

from deploy import compose
from deploy.env_file import SECRETS, read_env_file, set_values

ROOT = Path(__file__).resolve().parents[3]


def _up(tmp_path: Path, monkeypatch, capsys) -> tuple[int, list[str]]:
    # an engine address where none answers, whatever this host runs: the state of a host whose engine is stopped
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    monkeypatch.delenv("DIFFLM_COMPOSE", raising=False)
    monkeypatch.delenv("DIFFLM_DOCKER", raising=False)
    rc = compose.main(["up", "--env-file", str(tmp_path / ".env")])
    return rc, capsys.readouterr().err.strip().splitlines()


def test_a_fresh_clone_gets_its_secrets_generated(tmp_path, monkeypatch, capsys):
    """No .env: every secret generated into it (0600), as the docs say, before the engine is asked for."""
    rc, err = _up(tmp_path, monkeypatch, capsys)
    assert rc == 1, err
    values = read_env_file(tmp_path / ".env")
    assert set(SECRETS) <= values.keys() and all(values[k] for k in SECRETS)
    assert (tmp_path / ".env").stat().st_mode & 0o777 == 0o600


def test_no_engine_gets_one_line_naming_docker_and_how_to_start_it(tmp_path, monkeypatch, capsys):
    (tmp_path / ".env").write_text("MLFLOW_PORT=5000\n")  # secrets filled in by `up`, the port kept
    rc, err = _up(tmp_path, monkeypatch, capsys)
    assert rc == 1 and len(err) == 1, err
    (line,) = err
    assert "Docker" in line and "Error" not in line, line
    # the documented ways: install (no clients here) or start the engine that sees the cached images
    assert "`make docker-engine`" in line or "`make docker`" in line, line
    assert read_env_file(tmp_path / ".env")["MLFLOW_PORT"] == "5000"


def test_the_engine_sets_its_image_names_in_env_and_keeps_the_rest(tmp_path):
    """`python3 -m deploy.docker_local engine` writes the local image names and the build's torch index into .env:
    a value replaced in place, the others (secrets, ports, comments) kept, mode 0600."""
    env = tmp_path / ".env"
    env.write_text("# mine\nPOSTGRES_PASSWORD=abc\nDIFFLM_BASE_IMAGE=python:3.11-slim\n")
    env.chmod(0o644)
    set_values(env, {"DIFFLM_BASE_IMAGE": "local/python:3.11-bookworm", "DIFFLM_TORCH_INDEX_URL": "http://x/"})
    assert env.read_text().splitlines() == [
        "# mine",
        "POSTGRES_PASSWORD=abc",
        "DIFFLM_BASE_IMAGE=local/python:3.11-bookworm",
        "DIFFLM_TORCH_INDEX_URL=http://x/",
    ]
    assert env.stat().st_mode & 0o777 == 0o600


def test_no_schedule_is_active_until_asked_for():
    """`up` registers every deployment of prefect.yaml: a stack left up must not train every night unasked
    (docs/production-stack.md says how to resume the nightly schedule)."""
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    schedules = {d["name"]: d.get("schedules", []) for d in deployments}
    assert schedules["nightly-end-to-end"], "the nightly deployment lost its schedule"
    assert all(s.get("active") is False for entries in schedules.values() for s in entries), schedules
