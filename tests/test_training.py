"""Training under torchrun (gloo, CPU): checkpoints, resume equal to an uninterrupted run, failures."""

import shutil

import pytest

from conftest import tiny_config
from models import checkpointing
from models.launch import TrainingError, launch_training, read_metrics, run_dir


@pytest.mark.slow
def test_resume_reproduces_uninterrupted_run(session_dir, tiny_manifest):
    cfg = tiny_config(session_dir / "resume", "train.train_iters=12", "checkpoint.save_interval=6",
                      "train.log_interval=3", "train.eval_interval=6", "checkpoint.keep_last=5")
    info = launch_training(cfg, tiny_manifest, echo=lambda _: None)
    rdir = run_dir(cfg, tiny_manifest)
    full = {r["step"]: r for r in read_metrics(rdir) if "loss" in r}
    assert sorted(p.name for p in (rdir / "checkpoints").glob("iter_*")) == ["iter_0000006", "iter_0000012"]
    assert not info["reused"]

    # a finished run is reused, not retrained
    assert launch_training(cfg, tiny_manifest, echo=lambda _: None)["reused"]

    # simulate an interruption after iteration 6: drop the last checkpoint and metrics after it
    shutil.rmtree(rdir / "checkpoints" / "iter_0000012")
    (rdir / "checkpoints" / "latest").write_text("6")
    (rdir / "metrics.jsonl").write_text("")
    info = launch_training(cfg, tiny_manifest, echo=lambda _: None)
    resumed = {r["step"]: r for r in read_metrics(rdir) if "loss" in r}
    assert min(resumed) == 9  # it restarted after iteration 6, not from scratch
    for step in (9, 12):
        assert resumed[step]["loss"] == pytest.approx(full[step]["loss"], rel=1e-5, abs=1e-6)
    assert checkpointing.latest_iteration(rdir / "checkpoints") == 12


@pytest.mark.slow
def test_failed_training_reports_the_log(session_dir, tiny_manifest):
    broken = {**tiny_manifest, "splits": {**tiny_manifest["splits"],
              "train": {**tiny_manifest["splits"]["train"], "prefixes": ["/nonexistent/shard"]}}}
    cfg = tiny_config(session_dir / "broken", "train.train_iters=3", "train.warmup_iters=1")
    with pytest.raises(TrainingError, match="training failed .* full log"):
        launch_training(cfg, broken, echo=lambda _: None)
