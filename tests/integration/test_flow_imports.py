"""A served deployment's flow run (Prefect's runner loads `difflm.flows.<flow>` in a process of its own, without
`difflm`'s main) prints what `difflm run` prints: not megatron's import-time warnings that Apex and Transformer
Engine are absent."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration  # a fresh interpreter importing megatron (seconds)
def test_a_served_flows_import_prints_no_apex_or_transformer_engine_warnings():
    code = "import difflm.flows.pretrain, difflm.models.megatron.gpt, difflm.models.megatron.train"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default"}  # every warning shown once
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Apex" not in out.stderr and "Transformer Engine" not in out.stderr, out.stderr[-3000:]
