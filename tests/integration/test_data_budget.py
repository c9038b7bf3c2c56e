"""A run on a unique-data budget, its length given in epochs, through the pipeline's data-prep and train rows: the
length becomes steps over the subset's tokens, and the run records the unique tokens, the epochs planned and the
epochs seen next to its loss (metrics.jsonl and MLflow)."""

import math

import pytest
from helpers import tiny_config
from mlflow.tracking import MlflowClient

from difflm import tracking
from difflm.flows.pretrain import DATA_PREP, TRAIN
from difflm.flows.stages import PipelineRun, run_stages


@pytest.mark.integration  # torchrun, an MLflow store, Prefect
def test_a_run_in_epochs_of_a_budget_records_its_length(session_dir, tiny_manifest, prefect_harness, tmp_path):
    cfg = tiny_config(
        session_dir / "shared",  # the session's prep: only the subset and the run are new
        "data.unique_tokens=1000",
        "train.epochs=0.5",  # the subset is one long document: 0.5 epochs are ~24 steps
        "train.log_interval=4",
        "train.eval_interval=1000",
        "train.eval_iters=1",
        "checkpoint.save_interval=1000",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    )
    with tracking.pipeline_run(cfg, "budget", {"flow": "t"}) as run_id:
        run = PipelineRun(cfg, run_id, None, {})
        run_stages(run, [DATA_PREP, TRAIN])
    manifest, trained = run.manifest, run.trained
    unique = manifest.splits["train"].tokens
    assert manifest.budget["unique_tokens"] == 1000 and 1000 <= unique < tiny_manifest.splits["train"].tokens
    assert manifest.splits["valid"] == tiny_manifest.splits["valid"]
    iters = math.ceil(0.5 * unique / (4 * 32))  # test-tiny: global batch 4 x 32 tokens
    assert run.cfg.train.train_iters == iters and run.cfg.train.epochs is None
    assert trained.run.config().train.train_iters == iters and trained.run.is_finished(iters)

    records = trained.run.metrics()
    epochs = {r["step"]: r["epochs"] for r in records if "epochs" in r}
    assert epochs[iters] == pytest.approx(iters * 128 / unique) and 0.5 <= epochs[iters] < 0.5 + 128 / unique
    assert all("loss" in r for r in records if "epochs" in r)  # next to the loss

    client = MlflowClient(tracking.tracking_uri(cfg))
    parent = client.get_run(run_id)
    (stage,) = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}' and tags.stage = 'train'"
    )
    for params in (parent.data.params, stage.data.params):
        assert params["train.unique_tokens"] == str(unique) and params["train.train_iters"] == str(iters)
        assert float(params["train.planned_epochs"]) == pytest.approx(iters * 128 / unique, abs=1e-4)
    assert parent.data.params["train.epochs"] == "0.5" and parent.data.params["data.unique_tokens"] == "1000"
    history = client.get_metric_history(stage.info.run_id, "epochs")
    assert max(m.step for m in history) == iters and history[-1].value == pytest.approx(epochs[iters])
