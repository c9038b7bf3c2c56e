"""The Prefect stage summaries (plain markdown builders) and the stage cache keys, without Prefect."""

from pathlib import Path

from helpers import manifest_record

from difflm.config import load_config
from difflm.manifest import SplitStats
from difflm.models.evaluation.record import EvalRecord
from difflm.rundir import RunDir, TrainResult
from difflm.tasks import artifacts
from difflm.tasks.cache import cache_key, eval_done, eval_key, mark_eval_done

MANIFEST = manifest_record(
    "abc123",
    "/w/data/abc123",
    splits={
        "train": SplitStats(1200, 345678, sources={"enwiki": {"documents": 1200, "tokens": 345678}}),
        "valid": SplitStats(12, 3456),
    },
    skipped={"empty": 3, "too_short": 0},
)


def test_sparkline_follows_the_curve_and_resamples():
    assert artifacts.sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    assert artifacts.sparkline([1.0, 1.0]) == "▁▁"  # flat: no division by zero
    assert artifacts.sparkline([]) == ""
    long = artifacts.sparkline([float(i) for i in range(1000)], width=40)
    assert len(long) == 40 and long[0] == "▁" and long[-1] == "█"


def test_summaries_show_what_a_user_checks_first():
    data = artifacts.data_markdown(MANIFEST)
    assert "| train | enwiki | 1,200 | 345,678 |" in data and "empty 3" in data and "too_short" not in data
    assert "Instruction data" not in data
    sft = artifacts.data_markdown(MANIFEST.replace(kind="instruction", instruction={"template": "plain"}))
    assert "Instruction data (chat template `plain`), a loss mask beside each shard" in sft
    records = [
        {"step": s, "loss": 6.0 - s / 10, **({"val_loss": 6.1 - s / 10} if s % 5 == 0 else {})} for s in range(1, 21)
    ]
    train = artifacts.training_markdown(
        TrainResult(RunDir("/w/runs/difflm-noshift-abc"), Path("/c"), reused=False), records, cached=True
    )
    assert "difflm-noshift-abc" in train and "loss 5.9000 → 4.0000 over 20 steps" in train
    assert "| 20 | 4.1000 |" in train and "Prefect cache" in train
    ev = artifacts.evaluation_markdown(
        EvalRecord(
            mode="difflm-noshift",
            data_hash="abc",
            export="/w/runs/x/hf",
            device="cpu",
            dtype="float32",
            bounds={"trained": {"kind": "elbo", "nll_per_token": 4.5, "ppl": 90.0}},
            tasks={"cloze": {"acc": 0.25, "items": 8}},
            samples=[{"prompt": "The river", "completion": "flows"}],
        )
    )
    assert "| trained | elbo | 4.5000 | 90.00 |" in ev and "acc 0.250" in ev and "**The river** flows" in ev


def test_training_figure_from_the_mlflow_server():
    assert artifacts.mlflow_artifact_url("sqlite:///x.db", "r", "train/curves.png") is None
    url = artifacts.mlflow_artifact_url("http://h:5000", "r1", "train/curves.png")
    assert url == "http://h:5000/get-artifact?path=train/curves.png&run_id=r1"
    md = artifacts.training_markdown(TrainResult(RunDir("/w/runs/x"), Path("/c"), False), [], curves_url=url)
    assert f"![training curves]({url})" in md


def test_mlflow_links_only_for_a_server():
    assert artifacts.mlflow_run_url("sqlite:///x.db", "1", "r") is None
    assert (
        artifacts.mlflow_run_url("http://h:5000/", "1", "r")
        == "http://h:5000/#/experiments/1/runs/r?workflowType=machine_learning"
    )
    # the printed link: the run's shared training view (curves first), in the model-training view
    assert artifacts.mlflow_curves_url("sqlite:///x.db", "1", "r") is None
    assert (
        artifacts.mlflow_curves_url("http://h:5000/", "1", "r")
        == "http://h:5000/#/experiments/1/runs?viewStateShareKey=r&compareRunsMode=CHART&workflowType=machine_learning"
    )


def test_cache_keys_follow_the_inputs(tmp_path):
    assert cache_key("train", Path("/w/runs/a")) == cache_key("train", "/w/runs/a")
    assert cache_key("train", "/w/runs/a") != cache_key("train", "/w/runs/b") != cache_key("convert", "/w/runs/b")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "difflm_export.json").write_text('{"checkpoint": "/w/runs/a/checkpoints/iter_0000030"}')
    cfg = load_config("test-tiny")
    key = eval_key(cfg, MANIFEST, hf)
    assert key == eval_key(
        load_config("test-tiny", ["train.optimizer.lr=2e-3"]), MANIFEST, hf
    )  # training is not an input
    assert key != eval_key(load_config("test-tiny", ["eval.task_items=3"]), MANIFEST, hf)
    (hf / "difflm_export.json").write_text('{"checkpoint": "/w/runs/a/checkpoints/iter_0000040"}')
    assert key != eval_key(cfg, MANIFEST, hf)  # another checkpoint exported into the same folder
    out = tmp_path / "eval"
    out.mkdir()
    assert not eval_done(out, key)
    mark_eval_done(out, key)
    assert not eval_done(out, key)  # no results.json: not done
    (out / "results.json").write_text("{}")
    assert eval_done(out, key) and not eval_done(out, cache_key("evaluate", "other"))
