"""`difflm sft` from a pretrained test-tiny run (the suite's shared trained runs, tests/conftest.py `trained`), as a
user runs it: the command line, the preset sft-tiny on the seeded instruction tasks, masked diffusion and AR. The
held-out exact match rises from near 0 to a majority and the responses' NLL falls by nats, both models' figures are in the evaluation record, and the registered version's lineage names
the pretrained run. The parts that need no training: tests/unit/tasks/test_sft_command.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from mlflow.tracking import MlflowClient

from difflm.models.evaluation.record import EvalRecord
from difflm.models.evaluation.stages import convert_checkpoint

MODES = {"masked": [], "ar": ["diffusion.model_running_mode=ar"]}  # the source run's mode, and SFT's overrides


@pytest.fixture(scope="module")
def pretrained(trained, tiny_manifest):
    """`pretrained(mode)`: the shared trained run of `mode` with its export (what `difflm run` leaves)."""

    def get(mode: str) -> Path:
        run = trained(mode)
        convert_checkpoint(run.cfg, tiny_manifest, run.info)
        return run.info.run.path

    return get


@pytest.mark.slow(
    reason="SFT of a pretrained test-tiny run through the CLI: import, data prep, 200 steps, both models scored"
)
@pytest.mark.parametrize("mode", MODES)
def test_sft_raises_held_out_exact_match_and_registers_with_the_pretrained_run_as_lineage(
    session_dir, pretrained, mode
):
    source = pretrained(mode)
    workdir = session_dir / f"sft-{mode}"
    # a temporary Prefect server of its own; MLflow in the workdir's store (not one a test left in the env)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API") and k != "MLFLOW_TRACKING_URI"}
    argv = [sys.executable, "-m", "difflm.flows.cli", "sft", str(source), f"workdir={workdir}", *MODES[mode]]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]

    # the summary: the held-out exact match before and after, then `difflm run`'s fields
    found = re.search(r"held-out exact match: before ([\d.]+)  after ([\d.]+)  \((\d+) items\)", out)
    assert found, out[-3000:]
    before, after = float(found.group(1)), float(found.group(2))
    # the bar: from near 0 to a clear majority (sft-tiny: the copy task, document attention; docs/sft.md)
    assert before <= 0.1 and after > 0.5, (before, after)
    nll = re.search(r"held-out response NLL: before ([\d.]+)  after ([\d.]+) nats/token", out)
    assert nll and float(nll.group(1)) > float(nll.group(2)) + 2.0, out[-3000:]
    name = re.search(r"registered_model: (\S+)", out).group(1)
    version = re.search(r"\n\s+version: (\d+)", out).group(1)
    assert name.startswith("difflm-sft-tiny-")

    # the evaluation record: the tuned model's scores as the task `instructions`, the source's as its baseline
    summary = json.loads((workdir / "last_sft.json").read_text())
    record = EvalRecord.read(Path(summary["run_dir"]) / "eval")
    assert record.tasks["instructions"]["exact_match"] == pytest.approx(after, abs=5e-4)
    assert record.baseline["exact_match"] == pytest.approx(before, abs=5e-4)
    assert record.baseline["export"] == str(source / "hf")
    assert record.tasks["instructions"]["items"] == record.baseline["items"] == int(found.group(3))
    assert record.baseline["nll_per_token"] > record.tasks["instructions"]["nll_per_token"]

    # lineage: the SFT run and its registered version name the pretrained run
    client = MlflowClient(summary["mlflow_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.tags["flow"] == "sft-difflm" and run.data.tags["source.run_dir"] == str(source)
    assert run.data.metrics["eval.instructions.exact_match"] == pytest.approx(after, abs=5e-4)
    registered = client.get_model_version(name, version)
    assert registered.run_id == summary["mlflow_run_id"]
    assert registered.tags["source.run_dir"] == str(source)
    assert registered.tags["source.path"] == str(source / "hf")
    assert f"- trained from: run `{source}`" in registered.description
