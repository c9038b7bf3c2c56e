"""The typed records the stages hand on (Export, EvalRecord, and the PipelineRun that holds them) read what the
release before them wrote: its export, its results.json and the four results its Prefect cache stored
(tests/fixtures/records_before_typing, copied and relocated by `before_typing.relocate`); and the run's attributes
refuse a read before their stage and a row naming none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from before_typing import FIXTURE, PREFIX, RUN, STORAGE, STORED, keys, relocate, typed_run
from helpers import tiny_config
from prefect.results import ResultRecord
from prefect.serializers import JSONSerializer

from difflm.flows.pretrain import CONVERT, DATA_PREP, EVALUATE, PRETRAIN_STAGES, TRAIN
from difflm.flows.stages import PipelineRun, Slot, Stage, StageNotRun, run_stages
from difflm.manifest import DataManifest
from difflm.models.evaluation.record import EvalRecord, EvalRecordError
from difflm.models.hf.convert import load_hf
from difflm.models.hf.export import Export, ExportError
from difflm.rundir import TrainResult, exported_from, is_export_of
from difflm.tasks import cache


@pytest.fixture
def before(tmp_path) -> Path:
    """The old workdir, written (as far as any path in it says) at tmp_path/wd."""
    return relocate(tmp_path / "wd")


# ---- Export ----------------------------------------------------------------------------------------------------
def test_the_old_export_reads_as_an_export_and_still_loads(before):
    folder = before / RUN / "hf"
    export = Export.read(folder)
    ckpt = str(before / RUN / "checkpoints" / "iter_0000020")
    assert export == Export(folder, ckpt, format="difflm", mode="difflm-noshift", data_hash="ae93725590ed")
    assert export.parity is None and export.extra == {}  # no parity was measured for our own class
    assert export.is_of(ckpt) and is_export_of(folder, ckpt) and exported_from(folder) == ckpt
    model = load_hf(folder)  # as a user loads it: the code shipped in the folder, trust_remote_code
    with torch.no_grad():
        logits = model(torch.tensor([[3, 4, 5, 6]])).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()


def test_an_export_marker_round_trips_and_keeps_what_old_readers_read(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    stock = Export(folder, "/r/checkpoints/iter_0000007", "hf-stock", "ar", "abc", 3e-6, {"architecture": "Llama"})
    stock.write()
    marker = json.loads((folder / "difflm_export.json").read_text())
    assert marker["checkpoint"] == "/r/checkpoints/iter_0000007" and marker["architecture"] == "Llama"
    assert Export.read(folder) == stock and exported_from(folder) == stock.checkpoint
    # a marker of the release before (no format): a folder without our model code is a stock class
    (folder / "difflm_export.json").write_text(json.dumps({"checkpoint": "/c", "parity": 2e-5, "data_hash": "h"}))
    assert Export.read(folder) == Export(folder, "/c", "hf-stock", data_hash="h", parity=2e-5)
    (folder / "modeling_difflm.py").write_text("")
    assert Export.read(folder).format == "difflm"


def test_what_is_not_an_export_is_refused_with_what_to_do(tmp_path):
    assert Export.find(tmp_path) is None
    with pytest.raises(ExportError, match="not an HF export written by difflm.*difflm convert"):
        Export.read(tmp_path)
    (tmp_path / "difflm_export.json").write_text(json.dumps({"checkpoint": "/c", "format": "onnx"}))
    with pytest.raises(ExportError, match="'onnx' layout, which this version does not know"):
        Export.read(tmp_path)


# ---- EvalRecord ------------------------------------------------------------------------------------------------
def test_the_old_results_read_as_an_eval_record_and_write_back_the_same_json(before, tmp_path):
    path = before / RUN / "eval" / "results.json"
    record = EvalRecord.read(path.parent)
    assert (record.mode, record.data_hash, record.export) == (
        "difflm-noshift",
        "ae93725590ed",
        str(before / RUN / "hf"),
    )
    assert (record.device, record.dtype) == ("cpu", "float32") and record.task_settings == {
        "items": 6,
        "mc_samples": 4,
        "seed": 0,
    }
    assert record.trained["kind"] == "elbo" and set(record.tasks) == {"cloze", "choice", "documents"}
    assert record.samples[0]["model_calls"] == 4 and record.report is None and record.extra == {}
    assert record.to_dict() == json.loads(path.read_text())
    assert record.write(tmp_path / "again").read_text() == path.read_text()  # byte for byte


def test_a_newer_files_keys_are_kept_and_a_broken_file_is_named(tmp_path):
    newer = {**json.loads((FIXTURE / RUN / "eval" / "results.json").read_text()), "nfe": {"mean": 4.0}}
    record = EvalRecord.from_dict(newer)
    assert record.extra == {"nfe": {"mean": 4.0}} and record.to_dict() == newer
    (tmp_path / "results.json").write_text(json.dumps({"mode": "ar"}))
    with pytest.raises(EvalRecordError, match="without data_hash, export, bounds: evaluate the export again"):
        EvalRecord.read(tmp_path)
    with pytest.raises(EvalRecordError, match="no evaluation results at .*difflm eval"):
        EvalRecord.read(tmp_path / "nowhere")


# ---- Prefect's stored results -> the rows' typed values -----------------------------------------------------------
def _stored(workdir: Path, name: str):
    """A stored result as Prefect reads it back (its record's own serializer)."""
    return ResultRecord.deserialize((workdir / STORAGE / name).read_bytes()).result


def test_each_old_stored_result_reads_through_its_row_as_the_typed_record(before):
    new = keys(typed_run(before, at=before))
    values = {row.name: row.read(_stored(before, new[row.name])) for row in (DATA_PREP, TRAIN, CONVERT, EVALUATE)}
    assert isinstance(_stored(before, new["convert"]), str) and isinstance(_stored(before, new["evaluate"]), dict)
    manifest, trained, export, results = values["data-prep"], values["train"], values["convert"], values["evaluate"]
    assert isinstance(manifest, DataManifest) and manifest.hash == "ae93725590ed"
    assert manifest == DataManifest.read(before / "data" / "ae93725590ed" / "manifest.json")
    assert isinstance(trained, TrainResult) and trained.run.path == before / RUN and not trained.reused
    assert export == Export.read(before / RUN / "hf") and export.is_of(trained.checkpoint)
    assert results == EvalRecord.read(before / RUN / "eval").replace(
        report=str(before / "reports/data-ae93725590ed.md")
    )


def test_todays_typed_results_cross_prefects_store_and_read_back_the_same(before):
    run = typed_run(before, at=before)
    results = EvalRecord.read(before / RUN / "eval").replace(report="r.md", sweep=[{"steps": 2, "accuracy": 0.5}])
    serializer = JSONSerializer(jsonlib="json")  # what tasks/cache.py's run_stage stores with
    for row, value in ((DATA_PREP, run.manifest), (TRAIN, run.trained), (CONVERT, run.export), (EVALUATE, results)):
        back = serializer.loads(serializer.dumps(value))
        assert type(back) is type(value) and row.read(back) == value, row.name


def test_todays_rows_key_the_old_workdir_as_it_was_keyed(monkeypatch):
    """The four records the old release stored are found by today's cache keys (nothing recomputed after an
    upgrade). Keys name absolute paths: computed at the paths it wrote, its export's marker read from the fixture."""
    monkeypatch.setattr(cache, "exported_from", lambda hf: exported_from(FIXTURE / Path(hf).relative_to(PREFIX)))
    assert keys(typed_run(FIXTURE)) == STORED
    assert (FIXTURE / RUN / "eval" / ".cache_key").read_text().strip() == STORED["evaluate"]


# ---- PipelineRun's attributes ----------------------------------------------------------------------------------
def test_reading_a_result_before_its_stage_ran_names_that_stage(tmp_path):
    run = PipelineRun(tiny_config(tmp_path), None, None, {})
    with pytest.raises(StageNotRun, match=r"run\.manifest is not set: the `data-prep` stage sets it"):
        run.manifest  # noqa: B018
    run.manifest = DataManifest.read(FIXTURE / "data" / "ae93725590ed" / "manifest.json")
    with pytest.raises(StageNotRun, match=r"run\.export is not set: the `convert` stage"):
        EVALUATE.args(run, tmp_path, "key")  # a row reading an earlier row's result
    assert not hasattr(run, "export") and not run.has("export")
    run.export = Export(tmp_path, None)
    assert run.export == Export(tmp_path, None) and run.has("export")
    assert {row.slot for row in PRETRAIN_STAGES} <= {n for n, v in vars(PipelineRun).items() if isinstance(v, Slot)}


def test_a_row_naming_no_declared_attribute_is_refused_where_it_is_written(tmp_path):
    row = dict(task=lambda: None, output=lambda run: tmp_path, done=lambda run, out: True, args=lambda *a: ())
    with pytest.raises(TypeError, match="slot 'manfest' is not a result attribute of PipelineRun .*manifest"):
        Stage("typo", slot="manfest", **row)

    class QuantizedRun(PipelineRun):  # a pipeline with a stage of its own declares its slot
        quantized = Slot[str]("quantize")

    quantize = Stage("quantize", slot="quantized", **row)
    assert QuantizedRun.quantized.stage == "quantize"
    with pytest.raises(TypeError, match="PipelineRun has no slot 'quantized'"):  # declared, but not on this run
        run_stages(PipelineRun(tiny_config(tmp_path), None, None, {}), [quantize])
