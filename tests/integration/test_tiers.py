"""The fast tier keeps its promise (docs/testing.md): tests/conftest.py fails a unit test that starts a process,
even one that catches the error, or that uses more than its CPU budget; an integration test may do both. A test over
the long-test line (a minute; tests/support/timing.py) says why in its `slow` mark, or fails; and a run ends with the
tiers' times, under xdist too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

OFFENDERS = """
import os
import re
import subprocess
import sys
import time

import pytest


def test_cheap():
    assert sum(range(10)) == 45


def test_starts_the_cli():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_starts_a_shell_and_catches_the_error():
    try:
        os.system("true")
    except Exception:
        pass


def test_burns_cpu():
    start = time.process_time()
    while time.process_time() - start < 1.5:
        pass


@pytest.mark.integration
def test_an_integration_test_may_do_both():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    start = time.process_time()
    while time.process_time() - start < 1.5:
        pass
"""


def _outer_env() -> dict[str, str]:
    """This environment without the xdist worker's variables (the pytest started here is a run of its own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}


@pytest.mark.integration  # a pytest in a subprocess
def test_a_unit_test_that_starts_a_process_or_burns_cpu_fails_the_tier(tmp_path):
    (tmp_path / "test_offenders.py").write_text(OFFENDERS)
    path = os.pathsep.join(str(p) for p in (ROOT / "tests", ROOT / "tests" / "support", ROOT))  # conftest, helpers
    env = {**_outer_env(), "PYTHONPATH": path, "DIFFLM_UNIT_CPU_BUDGET": "1"}
    argv = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", "-rf"]
    proc = subprocess.run([*argv, "test_offenders.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert "3 failed, 2 passed" in out, out[-3000:]
    failed = {line.split("::")[1].split(" ")[0] for line in out.splitlines() if line.startswith("FAILED")}
    assert failed == {"test_starts_the_cli", "test_starts_a_shell_and_catches_the_error", "test_burns_cpu"}, out
    assert "a unit test started a process (subprocess" in out and "(os.system)" in out
    assert "over the budget of 1 s: mark it @pytest.mark.integration (or slow), or make it cheaper" in out
    assert "unit tests: 4," in out  # the summary line


LONG = """
import time

import pytest


@pytest.fixture(scope="module")
def started():
    time.sleep(2.5)  # a module's set-up is paid by its first test


@pytest.mark.slow
def test_long_without_a_reason(started):
    pass


@pytest.mark.slow(reason="it waits for a scheduler")
def test_long_with_its_reason():
    time.sleep(2.5)


pytestmark = pytest.mark.integration


def test_short():
    pass
"""


@pytest.mark.integration  # pytest in subprocesses
@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]], ids=["serial", "xdist"])
def test_a_long_test_names_its_reason_and_the_run_ends_with_the_tiers_times(tmp_path, workers):
    (tmp_path / "test_long.py").write_text(LONG)
    (tmp_path / "test_pure.py").write_text("def test_pure():\n    assert True\n")
    path = os.pathsep.join(str(p) for p in (ROOT / "tests", ROOT / "tests" / "support", ROOT))
    env = {**_outer_env(), "PYTHONPATH": path, "DIFFLM_LONG_TEST_S": "1", "DIFFLM_LONG_TEST_LOADED": "0"}
    argv = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", "-rf", *workers]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert "1 failed, 3 passed" in out, out[-3000:]
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "test_long_without_a_reason" in failed[0], out[-3000:]
    line = "1 s (1 s a worker)" if not workers else "2 s (1 s a worker)"
    assert f"(set-up included), over {line}: make it cheaper, or mark it @pytest.mark.slow(reason=" in out
    tiers = re.search(r"tiers: unit 1 tests [\d.]+ s, integration 1 tests [\d.]+ s, slow 2 tests (\d+) s", out)
    assert tiers and int(tiers[1]) >= 5, out[-3000:]  # both slow tests' seconds, whichever worker ran them
    assert re.search(r"; wall \d+ s", out)


@pytest.mark.integration
def test_make_help_lists_every_target():
    """`make` alone prints the targets (it did not exist: a new user had to read the Makefile), each of them."""
    makefile = (ROOT / "Makefile").read_text()
    targets = {line.split(":")[0] for line in makefile.splitlines() if re.match(r"^[a-z][a-z-]*:", line)}
    assert {"help", "env", "demo", "test", "mlflow-ui"} <= targets
    for command in (["make", "help"], ["make"]):
        shown = subprocess.run([*command, "-s", "-C", str(ROOT)], capture_output=True, text=True, check=True).stdout
        listed = {line.split()[1] for line in shown.splitlines() if line.startswith("  make ")}
        assert listed == targets, (sorted(targets - listed), shown)
