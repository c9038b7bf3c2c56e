"""Today's pipeline on a workdir the release before the typed records wrote (tests/fixtures/records_before_typing,
relocated): every stage is reused from what that release left (its Prefect records: a dict, TrainResult JSON, a
path, a dict), nothing is trained, exported or evaluated again, and the run holds typed records."""

from __future__ import annotations

import logging

import pytest
from before_typing import RUN, STORAGE, relocate
from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings

from difflm import tracking
from difflm.flows.pretrain import run_pipeline
from difflm.manifest import DataManifest
from difflm.models.evaluation.record import EvalRecord
from difflm.models.hf.export import Export
from difflm.rundir import RunDir, TrainResult


@pytest.mark.slow
def test_todays_pipeline_reuses_every_stage_of_an_old_workdir_and_holds_typed_records(tmp_path, prefect_harness):
    wd = relocate(tmp_path / "wd")
    untouched = [
        wd / RUN / "metrics.jsonl",
        wd / RUN / "checkpoints" / "latest",
        wd / RUN / "hf" / "difflm_export.json",
        wd / RUN / "hf" / "model.safetensors",
        wd / RUN / "eval" / "results.json",
        wd / "data" / "ae93725590ed" / "manifest.json",
    ]
    before = {path: path.read_bytes() for path in untouched}
    cfg = RunDir(wd / RUN).config()  # the config it was trained with (`difflm run` of that workdir again)
    stages: dict[str, str] = {}
    # the workdir's own Prefect store, as the CLI points Prefect at <workdir>/.prefect
    with temporary_settings({PREFECT_RESULTS_LOCAL_STORAGE_PATH: wd / STORAGE}):
        with tracking.pipeline_run(cfg, "before-typing", {"flow": "test"}) as run_id:
            summary, run = run_pipeline(cfg, run_id, logging.getLogger("test"), stages)

    assert stages == dict.fromkeys(("data-prep", "train", "convert", "evaluate"), "cached")  # Prefect answered
    assert {path: path.read_bytes() for path in untouched} == before  # nothing written again
    assert sorted(p.name for p in (wd / RUN / "checkpoints").iterdir()) == ["iter_0000020", "latest"]

    assert isinstance(run.manifest, DataManifest) and run.manifest.hash == "ae93725590ed"
    assert isinstance(run.trained, TrainResult) and run.trained.checkpoint == wd / RUN / "checkpoints" / "iter_0000020"
    assert isinstance(run.export, Export) and run.export == Export.read(wd / RUN / "hf")
    assert (run.export.format, run.export.parity) == ("difflm", None) and run.export.is_of(run.trained.checkpoint)
    assert isinstance(run.results, EvalRecord) and run.results.to_dict() == {
        **EvalRecord.read(wd / RUN / "eval").to_dict(),
        "report": str(wd / "reports" / "data-ae93725590ed.md"),  # what that release's evaluate task returned
    }
    assert summary["hf_dir"] == str(wd / RUN / "hf") and summary["validation"] == run.results.bounds
    assert summary["registered_model"] and summary["version"] == "1"  # registered from the typed records
