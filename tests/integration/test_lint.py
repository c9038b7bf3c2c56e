"""ruff lint and format check over the whole tree and mypy over the typed core (rules in pyproject.toml): a slip fails the suite
here, with the command that fixes it, rather than in review."""

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
    """mypy over the packages pyproject.toml's [tool.mypy] names (the objective, the config, the megatron
    composition): a typed value passed where another is expected fails here."""
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"mypy found problems (run `make lint` to see them again):\n{proc.stdout}{proc.stderr}"
