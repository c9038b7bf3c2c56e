"""The stage flows that work on an existing run, each alone on a real Prefect server (test harness):
`convert-checkpoint` (megatron <-> HF) and `evaluate-latest` (score the newest checkpoint while a run trains)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from servers import BIN, stop

from difflm import tracking
from difflm.flows.cli import main
from difflm.flows.convert import convert_checkpoint
from difflm.flows.evaluate_latest import evaluate_latest
from difflm.models.evaluation.stages import EvaluationError
from difflm.models.hf.convert import ConversionError, load_hf, load_megatron_weights
from difflm.rundir import RunDir
from difflm.tasks.latest import evaluated_scores
from difflm.tasks.sources import stage_config

# every test here uses trained_run, the shared run trained through torchrun: multi-process, so out of make test-dev
pytestmark = pytest.mark.slow

FINAL = 16  # the shared masked run's last checkpoint (helpers.TRAINED: one every 4)


@pytest.fixture(scope="module")
def trained_run(trained) -> Path:
    """The shared masked run: complete checkpoints at iterations 4, 8, 12 and 16 (its own copy where a test
    changes it)."""
    return trained("masked").info.run.path


def _copy_run(run: Path, workdir: Path, latest: int) -> Path:
    """A copy of the run in a workdir of its own (its own MLflow store), as if training had saved checkpoints
    4 and 8 so far, `latest` naming its newest complete one."""
    copy = workdir / "runs" / run.name
    later = {f"iter_{i:07d}" for i in range(12, FINAL + 1, 4)}
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("exports", "eval_latest", "hf", "eval", *later))
    (copy / "checkpoints" / "latest").write_text(str(latest))
    return copy


def _model_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    return {
        k: v
        for k, v in load_megatron_weights(ckpt).items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }


def test_convert_checkpoint_flow_both_ways(trained_run, prefect_harness, tmp_path):
    # a run directory: its newest complete checkpoint, exported inside the run (a copy: the shared run stays as
    # it was trained)
    trained_run = _copy_run(trained_run, tmp_path / "work", latest=8)
    to_hf = convert_checkpoint(source=str(trained_run))
    assert to_hf["to"] == "hf" and to_hf["iteration"] == 8 and not to_hf["reused"]
    assert Path(to_hf["out_dir"]) == trained_run / "exports" / "iter_0000008"
    assert load_hf(Path(to_hf["out_dir"])).config.num_hidden_layers == 2
    assert json.loads((Path(to_hf["out_dir"]) / "difflm_export.json").read_text())["iteration"] == 8
    assert convert_checkpoint(source=str(trained_run))["reused"]  # the same checkpoint: not exported again

    # the export back to megatron (direction inferred; the run's config found through the export's provenance)
    back = convert_checkpoint(source=to_hf["out_dir"])
    assert back["to"] == "megatron" and back["run_dir"] == str(trained_run)
    assert Path(back["out_dir"]) == trained_run / "exports" / "iter_0000008-megatron"
    original, again = (
        _model_tensors(trained_run / "checkpoints" / "iter_0000008"),
        _model_tensors(Path(back["out_dir"])),
    )
    assert again.keys() and again.keys() <= original.keys()
    assert all(torch.equal(original[k], again[k]) for k in again)

    # an older checkpoint folder, explicit direction and output folder
    older = convert_checkpoint(
        source=str(trained_run / "checkpoints" / "iter_0000004"), to="hf", out_dir=str(tmp_path / "hf4")
    )
    assert older["iteration"] == 4 and (tmp_path / "hf4" / "model.safetensors").exists()


def test_convert_says_what_to_pass_for_other_folders(trained_run, prefect_harness, tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    with pytest.raises(ConversionError, match="neither a run directory.*pass a run directory"):
        convert_checkpoint(source=str(tmp_path / "notes"))
    with pytest.raises(ConversionError, match="converts to hf, not megatron"):
        convert_checkpoint(source=str(trained_run), to="megatron")
    (tmp_path / "runs" / "young" / "checkpoints").mkdir(parents=True)
    shutil.copy(trained_run / "config.yaml", tmp_path / "runs" / "young")
    with pytest.raises(ConversionError, match="without a complete checkpoint yet"):
        convert_checkpoint(source=str(tmp_path / "runs" / "young"))

    with pytest.raises(ConversionError, match="does not fit the model of this config"):
        convert_checkpoint(source=str(trained_run), overrides=["model.hidden_size=64"], out_dir=str(tmp_path / "x"))

    # the CLI: the same message, no traceback; and a plain (no Prefect) conversion
    assert main(["convert", str(tmp_path / "notes")]) == 1
    err = capsys.readouterr().err
    assert "neither a run directory" in err and "Traceback" not in err
    assert main(["convert", str(trained_run / "checkpoints" / "iter_0000004"), "--out", str(tmp_path / "cli")]) == 0
    assert "Hugging Face export" in capsys.readouterr().out and (tmp_path / "cli" / "config.json").exists()

    # an output folder holding anything else is never replaced, in either direction: it loses nothing
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    for source in (trained_run / "checkpoints" / "iter_0000004", tmp_path / "cli"):
        assert main(["convert", str(source), "--out", str(tmp_path / "mine")]) == 1
        assert "nothing was written; pass a new or empty folder" in capsys.readouterr().err
    assert [f.name for f in (tmp_path / "mine").iterdir()] == ["thesis.tex"]


def test_evaluate_latest_scores_each_new_checkpoint_once(trained_run, prefect_harness, tmp_path, capsys):
    run = _copy_run(trained_run, tmp_path, latest=4)  # as if training had saved only iteration 4 so far
    first = evaluate_latest(run_dir=str(run))
    assert first["iteration"] == 4 and first["kind"] == "elbo" and 0 < first["score"] < 20 and not first.get("skipped")
    assert first["sequences"] <= 16
    again = evaluate_latest(run_dir=str(run))
    assert again["skipped"] == "already evaluated" and again["score"] == first["score"]

    # a newer complete checkpoint, and an unfinished save beyond it that checkpoints/latest does not name yet
    (run / "checkpoints" / "iter_0000012").mkdir()
    (run / "checkpoints" / "latest").write_text("8")
    newer = evaluate_latest(run_dir=str(run))
    assert newer["iteration"] == 8 and newer["score"] != first["score"]
    assert sorted(evaluated_scores(RunDir(run))) == [4, 8]

    # no training MLflow run records this run directory: one run of its own, a point per checkpoint
    cfg = stage_config(RunDir(run))
    assert Path(cfg.workdir) == tmp_path  # the run's own config, its MLflow store beside the copied run
    mlflow.set_tracking_uri(tracking.tracking_uri(cfg))
    client = MlflowClient()
    mine = client.get_run(newer["mlflow_run_id"])
    assert first["mlflow_run_id"] == mine.info.run_id and mine.data.tags["difflm.run_dir"] == str(run)
    history = client.get_metric_history(mine.info.run_id, "eval_latest.nll_per_token")
    assert [(m.step, m.value) for m in history] == [
        (4, pytest.approx(first["score"])),
        (8, pytest.approx(newer["score"])),
    ]

    # while pretrain-difflm trains this run (its MLflow run RUNNING, train.run_dir not tagged yet), the score
    # goes into that run, found through its resolved config
    manifest = RunDir(run).manifest()
    with tracking.pipeline_run(cfg, "training", {"flow": "pretrain-difflm", "data.hash": manifest.hash}) as train_id:
        forced = evaluate_latest(run_dir=str(run), force=True)
    assert forced["mlflow_run_id"] == train_id
    assert [m.step for m in client.get_metric_history(train_id, "eval_latest.ppl")] == [8]

    # the CLI runs the same flow, with the run's own config
    assert main(["eval-latest", str(run)]) == 0
    assert "skipped: already evaluated (iteration 8" in capsys.readouterr().out


def test_evaluate_latest_rejects_what_is_not_a_run(trained_run, prefect_harness, tmp_path):
    with pytest.raises(EvaluationError, match=r"inside one: pass .*runs"):
        evaluate_latest(run_dir=str(trained_run / "checkpoints" / "iter_0000008"))
    young = tmp_path / "runs" / "young"
    (young / "checkpoints").mkdir(parents=True)
    for name in ("config.yaml", "data_manifest.json"):
        shutil.copy(trained_run / name, young)
    assert evaluate_latest(run_dir=str(young))["skipped"] == "no complete checkpoint yet"


@pytest.mark.slow(reason="a Prefect server whose scheduler creates the flow runs: it waits for two of them")
def test_scheduled_evaluate_latest_scores_new_checkpoints_as_they_appear(trained_run, tmp_path, prefect_server):
    """`difflm serve evaluate-latest` on a real Prefect server: the interval schedule creates the flow runs,
    and each new complete checkpoint of the (still training) run gets scored once, at its step in MLflow."""
    run = _copy_run(trained_run, tmp_path / "work", latest=4)  # only iteration 4 saved so far
    server = prefect_server(PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2", PREFECT_RUNNER_POLL_FREQUENCY="2")
    env = server.env
    serve, log = None, tmp_path / "serve.log"

    def wait_for(iteration: int, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline and iteration not in evaluated_scores(RunDir(run)):
            assert serve.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
        assert iteration in evaluated_scores(RunDir(run)), log.read_text()[-5000:]

    try:
        serve = subprocess.Popen(
            [
                str(BIN / "difflm"),
                "serve",
                "evaluate-latest",
                "--name",
                "ci",
                "--run-dir",
                str(run),
                "--interval",
                "10",
                "--max-sequences",
                "4",
            ],
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        wait_for(4)
        (run / "checkpoints" / "latest").write_text("8")  # training saved a newer checkpoint
        wait_for(8)
        runs = subprocess.run(
            [str(BIN / "prefect"), "flow-run", "ls", "--flow-name", "evaluate-latest", "--state", "COMPLETED"],
            env={**env, "COLUMNS": "250"},
            capture_output=True,
            text=True,
        )
        assert runs.stdout.count("COMPLETED") >= 2, runs.stdout  # runs the schedule created, each finished
    finally:
        if serve:
            stop(serve)
        server.stop()
    cfg = stage_config(RunDir(run))
    mlflow.set_tracking_uri(tracking.tracking_uri(cfg))
    (mine,) = MlflowClient().search_runs(
        [mlflow.get_experiment_by_name(cfg.tracking.experiment).experiment_id], "tags.flow = 'evaluate-latest'"
    )
    steps = [m.step for m in MlflowClient().get_metric_history(mine.info.run_id, "eval_latest.nll_per_token")]
    assert steps == [4, 8]  # each checkpoint once, although the schedule ran more often
