"""`difflm adapt WRONG_FOLDER`, as a new user types it: one line, a nonzero exit, no server, as fast as `difflm
config show` (it took a Prefect server, a flow run, a 24-line traceback and 43 s)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # the CLI in subprocesses

ROOT = Path(__file__).resolve().parents[2]
# the command in a process of its own, then what it imported: Prefect is imported before its server starts
CLI = (
    "import json, sys\nfrom difflm.flows.cli import main\nrc = main(sys.argv[1:])\n"
    "print(json.dumps({'rc': rc, 'prefect': any(m.split('.')[0] == 'prefect' for m in sys.modules),"
    " 'torch': 'torch' in sys.modules}))"
)


def _cli(*argv: str) -> tuple[dict, str, float, float]:
    """(result, stderr, wall seconds, CPU seconds) of one CLI process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("PREFECT_API_URL", None)  # as a new user: no server configured, the CLI would start one
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CLI, *argv], capture_output=True, text=True, env=env, timeout=300)
    wall, after = time.monotonic() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr, wall, cpu


def test_adapt_of_a_wrong_folder_is_one_line_with_no_server_as_fast_as_config_show(tmp_path):
    workdir = tmp_path / "work"
    shown, _, _, floor = _cli("config", "show", f"workdir={tmp_path / 'shown'}")  # the cost of any command: imports
    assert shown["rc"] == 0 and not shown["prefect"]
    result, err, wall, cpu = _cli("adapt", str(tmp_path / "WRONG_FOLDER"), f"workdir={workdir}")
    # the folder is checked before the config is built: not even torch (about 2.5 s of imports) is loaded
    assert result == {"rc": 1, "prefect": False, "torch": False}, err
    assert err.startswith("difflm: ") and err.count("\n") == 1 and "no such file or folder" in err, err
    assert not workdir.exists()  # not even Prefect's state folder: nothing was set up for a server
    # CPU time, not wall time: the check holds on a loaded machine (about 0.5 s; config show, which loads torch, 3 s)
    assert cpu < min(floor, 1.5), (cpu, floor, wall)


def test_a_config_warning_is_one_line_naming_the_setting():
    """A setting that works but is likely a mistake (an FFN width that leaves partial GEMM tiles on GPUs) is one
    `warning:` line saying what to set, not Python's warning with a pydantic file:line and source line."""
    result, err, _, _ = _cli("config", "show", "model.hidden_size=1024", "model.ffn_hidden_size=1000")
    assert result["rc"] == 0
    warned = [line for line in err.splitlines() if "ffn_hidden_size" in line]
    assert warned == [
        "warning: model.ffn_hidden_size=1000 is not a multiple of 128: on GPUs every MLP matmul leaves partial "
        "tiles; e.g. model.ffn_hidden_size=1024"
    ], err[-2000:]
    assert "pydantic" not in err and "UserWarning" not in err
