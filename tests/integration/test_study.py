"""A smoke study (2 families x 2 epochs x 1 budget) through the `study` flow: a nested MLflow run per point under
the study's parent, the results table and plot in the study's folder and the parent run, every point scored on
the same held-out tokens, and a rerun that reuses every point (no stage runs again)."""

import csv
import time

import pytest
from mlflow.tracking import MlflowClient

from difflm.flows.study import study

SPEC = """
name: smoke
preset: test-tiny
base:
  - workdir={workdir}
  - tracking.tracking_uri=sqlite:///{store}
  - tracking.registry=false
  - train.optimizer.lr=0.0021   # runs of this test's own (the session's data prep is shared)
  - train.schedule.warmup_iters=1
  - train.log_interval=2
  - train.eval_interval=1000
  - train.eval_iters=1
  - checkpoint.save_interval=1000
  - eval.task_items=0
  - eval.num_samples=0
  - eval.max_sequences=4
families:
  masked: [diffusion.model_running_mode=difflm-noshift]
  ar: [diffusion.model_running_mode=ar]
unique_tokens: [1000]
epochs: [0.05, 0.1]
parallel: 2
"""


@pytest.mark.integration  # torchrun per point, an MLflow store, Prefect
@pytest.mark.slow(
    reason="a study of two points: a torchrun each, nested MLflow runs, the table and plot, then the reuse"
)
def test_a_smoke_study_nests_tabulates_plots_and_reuses(session_dir, tiny_manifest, prefect_harness, tmp_path):
    path = tmp_path / "study.yaml"
    store = tmp_path / "mlflow.db"
    path.write_text(SPEC.format(workdir=session_dir / "shared", store=store))
    start = time.monotonic()
    first = study(str(path))
    print(f"first study run: {time.monotonic() - start:.0f} s")
    rows = first["rows"]
    assert {(r["family"], r["epochs"]) for r in rows} == {(f, e) for f in ("masked", "ar") for e in (0.05, 0.1)}
    assert all(r["status"].startswith("ran") and "train" in r["status"] for r in rows), rows
    assert len({r["heldout_tokens"] for r in rows}) == 1  # the same held-out tokens for every point
    by = {(r["family"], r["epochs"]): r for r in rows}
    assert by["masked", 0.1]["steps"] > by["masked", 0.05]["steps"] and by["ar", 0.1]["bound"] == "exact"
    assert by["masked", 0.1]["bound"] == "elbo"
    assert by["ar", 0.1]["tokens_seen"] == by["ar", 0.1]["steps"] * 4 * 32  # test-tiny: 4 x 32 tokens a step
    assert by["ar", 0.1]["subset_tokens"] >= 1000  # whole documents
    assert (
        0.1
        <= by["ar", 0.1]["epochs_seen"]
        == pytest.approx(by["ar", 0.1]["tokens_seen"] / by["ar", 0.1]["subset_tokens"], abs=1e-4)
    )

    out = session_dir / "shared" / "studies" / "smoke"
    assert first["out_dir"] == str(out) and (out / "study.png").stat().st_size > 10_000
    with (out / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and {t["family"] for t in table} == {"masked", "ar"}
    assert float(table[0]["validation_nll"]) > 0
    assert "crossover" in (out / "results.md").read_text() and first["crossover_line"].startswith("1,000 unique")
    with (out / "curves.csv").open() as f:
        curves = list(csv.DictReader(f))
    # validated after the last step only (train.eval_interval is past it): a line per point, at its steps
    assert sorted((c["family"], float(c["epochs"]), int(c["step"])) for c in curves) == sorted(
        (f, e, by[f, e]["steps"]) for f, e in by
    )
    assert all(float(c["val_loss"]) > 0 for c in curves)

    client = MlflowClient(f"sqlite:///{store}")
    parent = client.get_run(first["mlflow_run_id"])
    assert parent.data.tags["flow"] == "study" and "study.crossover" in parent.data.tags
    assert parent.data.tags["study.half_life.ar"] == "absent: needs 3 epochs above 1; has 0"  # under one epoch
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "study")}
    assert artifacts >= {"study/results.csv", "study/results.md", "study/curves.csv", "study/study.png"}
    points = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(p.info.run_name for p in points) == sorted(f"smoke/{f}-u1000-e{e:g}" for f, e in by)
    assert {p.info.run_id for p in points} == {r["mlflow_run_id"] for r in rows}
    stages = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{points[0].info.run_id}' and tags.stage = 'train'"
    )
    assert len(stages) == 1  # each point's stages nest under it as in any pipeline run

    start = time.monotonic()
    again = study(str(path))
    print(f"rerun: {time.monotonic() - start:.0f} s")
    assert [r["status"] for r in again["rows"]] == ["reused"] * 4  # no stage ran: nothing retrained
    assert [r["validation_nll"] for r in again["rows"]] == [r["validation_nll"] for r in rows]
