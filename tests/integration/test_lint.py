"""ruff lint and format check over the whole tree and mypy over the typed core (rules in pyproject.toml): a slip fails the suite
here, with the command that fixes it, rather than in review."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # ruff in a subprocess over the tree (make lint)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args, fix",
    [(["check"], "ruff check --fix ."), (["format", "--check"], "ruff format .")],
    ids=["check", "format"],
)
def test_ruff_is_clean(args, fix):
    proc = subprocess.run([sys.executable, "-m", "ruff", *args, "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"ruff {' '.join(args)} found problems; run `{fix}`:\n{proc.stdout}{proc.stderr}"


def test_the_core_type_checks():
    """mypy over the files pyproject.toml's [tool.mypy] names (the objective, the config, the records handed between
    stages, the megatron composition, the Prefect tasks and the flows): a typed value passed where another is
    expected fails here. Every module of tasks/ and flows/ is among them (a glob that matched nothing, or a link
    mypy did not follow, would check less without saying so)."""
    proc = subprocess.run([sys.executable, "-m", "mypy", "--verbose"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"mypy found problems (run `make lint` to see them again):\n{proc.stdout}"
    modules = set(re.findall(r"Found source: +BuildSource\(path='[^']+', module='([\w.]+)'", proc.stderr))
    for folder in ("tasks", "flows"):
        expected = {f"difflm.{folder}.{f.stem}" for f in (ROOT / folder).glob("*.py") if f.stem != "__init__"}
        assert expected <= modules, f"mypy did not check {sorted(expected - modules)}"
    assert {"difflm.manifest", "difflm.models.hf.export", "difflm.models.evaluation.record"} <= modules
