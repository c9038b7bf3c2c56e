"""ruff lint and format check over the whole tree (rules in pyproject.toml): a style slip fails the suite
here, with the command that fixes it, rather than in review."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # ruff in a subprocess over the tree (make lint)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "args, fix",
    [(["check"], "ruff check --fix ."), (["format", "--check"], "ruff format .")],
    ids=["check", "format"],
)
def test_ruff_is_clean(args, fix):
    proc = subprocess.run([sys.executable, "-m", "ruff", *args, "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"ruff {' '.join(args)} found problems; run `{fix}`:\n{proc.stdout}{proc.stderr}"
