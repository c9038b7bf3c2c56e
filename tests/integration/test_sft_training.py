"""Training on instruction data under torchrun (gloo, CPU): data prep's shipped tasks (demo:instructions) train the
tiny model, and the loss is the response-only objective (the same windows read as pretraining data train on
another loss)."""

from __future__ import annotations

import math

import pytest
from helpers import tiny_config

from difflm.data_prep.pipeline import prepare_data
from difflm.models.launch.torchrun import launch_training, read_metrics

SHORT = (
    "train.train_iters=4",
    "train.log_interval=1",
    "train.eval_interval=4",
    "checkpoint.save_interval=4",
    "train.schedule.warmup_iters=1",
    "model.document_attention=true",
)


@pytest.mark.slow(
    reason="an instruction data prep and two 4-step torchrun trainings (instruction data, and the same windows read "
    "as text): 60-90 s on 2 cores, most of it two process starts"
)
def test_a_short_run_trains_on_the_responses_of_the_shipped_tasks(session_dir, tiny_manifest):
    data = prepare_data(
        tiny_config(
            session_dir / "sft-data",
            f"tokenizer.path={tiny_manifest.tokenizer.path}",
            "data.kind=instruction",
            "data.sources=[demo:instructions]",
            "data.max_documents=300",
        )
    )
    assert data.loss_masks
    sft = launch_training(tiny_config(session_dir / "sft", *SHORT), data, echo=lambda _: None)
    rows = read_metrics(sft.run.path)
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    assert len(vals) == 2 and all(math.isfinite(v) and v > 0 for v in vals)  # steps 0 and 4: the responses' bound
    # the same windows, the same noise, the same initial model, read as pretraining data: every token scored
    text = launch_training(
        tiny_config(session_dir / "sft-as-text", *SHORT), data.replace(kind="pretraining"), echo=lambda _: None
    )
    first = next(r["loss"] for r in read_metrics(text.run.path) if "loss" in r)
    assert first != pytest.approx(losses[1], rel=1e-3), "the response mask never reached the loss"
