"""The adaptation flow's stages: the source AR model is the adapted model's baseline, so no randomly initialised
model of the source's size is scored (minutes on a CPU for a 135M model, and meaningless next to the source)."""

from __future__ import annotations

from pathlib import Path

from before_typing import DATA, FIXTURE

from difflm.config import load_config
from difflm.flows.adapt import ADAPT_STAGES
from difflm.flows.pretrain import PRETRAIN_STAGES
from difflm.flows.stages import PipelineRun
from difflm.manifest import DataManifest
from difflm.models.hf.export import Export
from difflm.tasks.stages import evaluate_task


def _untrained(stages, run: PipelineRun) -> bool:
    evaluate = next(s for s in stages if s.name == "evaluate")
    assert evaluate.task is evaluate_task
    return evaluate.args(run, "out", "key")[4]  # evaluate_task(cfg, manifest, hf_dir, out_dir, untrained, key)


def test_adaptation_scores_no_random_init_but_pretraining_still_does():
    run = PipelineRun(load_config("tiny-cpu"), None, None, {})
    run.manifest, run.export = DataManifest.read(FIXTURE / DATA / "manifest.json"), Export(Path("hf"), None)
    assert _untrained(ADAPT_STAGES, run) is False
    assert _untrained(PRETRAIN_STAGES, run) is True  # from scratch, a random init is the only baseline
    assert [s.name for s in ADAPT_STAGES][: len(PRETRAIN_STAGES)] == [s.name for s in PRETRAIN_STAGES]
