"""The data manifest as one typed record (difflm.manifest): a manifest written by the release before it existed
loads unchanged and writes back every key it had, a file that is no manifest is one ManifestError saying what to
do, and the record crosses a file and Prefect's JSON result store (the data-prep stage's cache) unchanged.

The fixtures are real outputs of the previous release (tests/fixtures/records_before_typing/): data prep's
manifest.json and a run's copy of it, data_manifest.json. The paths inside them name a workdir that does not exist
here; reading a manifest never needs them to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import manifest_record
from prefect.results import ResultRecord, ResultRecordMetadata
from prefect.serializers import JSONSerializer

from difflm.errors import UserError
from difflm.manifest import DataManifest, ManifestError, SplitStats, TokenizerInfo, loss_mask_prefix
from difflm.rundir import RunDir

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "records_before_typing"
OLD = ("manifest.json", "data_manifest.json")


@pytest.mark.parametrize("name", OLD)
def test_a_manifest_of_the_previous_release_loads_and_writes_back_every_key(name):
    raw = json.loads((FIXTURES / name).read_text())
    assert "kind" not in raw  # written before manifests had a kind

    m = DataManifest.read(FIXTURES / name)
    assert (m.hash, m.dir, m.kind) == ("ae93725590ed", raw["dir"], "pretraining")
    assert m.tokenizer == TokenizerInfo(
        path=raw["tokenizer"]["path"],
        vocab_size=512,
        eos_id=0,
        mask_id=1,
        pad_id=2,
        sha256=raw["tokenizer"]["sha256"],
        special_ids=(0, 1, 2),
    )
    assert m.tokenizer.json_file == str(Path(raw["tokenizer"]["path"]) / "tokenizer.json")
    assert set(m.splits) == {"train", "valid", "test"}
    assert m.split("train") == SplitStats(
        documents=37,
        tokens=604169,
        prefixes=tuple(raw["splits"]["train"]["prefixes"]),
        weights=(1.0,),
        sources={"enwiki": {"documents": 37, "tokens": 604169}},
        data_path=raw["splits"]["train"]["data_path"],
    )
    assert m.unique_tokens == 604169 and m.split("test").prefixes == ()
    assert m.sources[0]["license"].startswith("CC BY-SA") and m.config["data"]["max_documents"] == 40
    assert m.budget is None and m.seconds == 0.76

    written = m.to_dict()
    assert written.pop("kind") == "pretraining"  # the one key added since
    assert written == raw  # every other key, with its value, as the previous release wrote it


def test_reading_a_manifest_needs_none_of_the_paths_it_names(tmp_path):
    text = (FIXTURES / "manifest.json").read_text().replace(str(Path("/work/before/wd")), str(tmp_path / "absent"))
    (tmp_path / "manifest.json").write_text(text)
    m = DataManifest.read(tmp_path / "manifest.json")
    assert m.dir == str(tmp_path / "absent" / "data" / m.hash) and not Path(m.dir).exists()
    assert m.split("valid").prefixes[0].startswith(str(tmp_path / "absent"))


def test_a_run_directory_of_the_previous_release_reads_its_manifest(tmp_path):
    run = RunDir(tmp_path / "runs" / "difflm-noshift-ae93725590ed-fec8076e2812")
    run.path.mkdir(parents=True)
    shutil.copy(FIXTURES / "data_manifest.json", run.manifest_file)
    assert run.manifest() == DataManifest.read(FIXTURES / "manifest.json")  # the run's copy is the data's manifest
    assert run.data_hash() == "ae93725590ed"


def test_write_then_read_gives_the_same_record(tmp_path):
    old = DataManifest.read(FIXTURES / "manifest.json")
    assert DataManifest.read(old.write(tmp_path / "manifest.json")) == old
    assert json.loads((tmp_path / "manifest.json").read_text())["kind"] == "pretraining"
    assert not list(tmp_path.glob("*.part"))  # written whole, then moved in place

    budget = {"unique_tokens": 1000, "subset_seed": 0, "tokens": 1010, "from": old.dir}
    template = {"template": "plain", "chat_template": None, "special_tokens": {}, "fields": {"messages": "messages"}}
    other = old.replace(
        kind="instruction", hash="b" * 12, budget=budget, skipped={"dropped_short": 3}, instruction=template
    )
    back = DataManifest.read(other.write(tmp_path / "other.json"))
    assert back == other and back.kind == "instruction" and back.budget == budget and back.instruction == template
    assert back.loss_masks and not old.loss_masks and "instruction" not in old.to_dict()
    assert loss_mask_prefix("/d/train/src/00000_tokens") == "/d/train/src/00000_tokens_loss_mask"
    assert back.to_dict() == other.to_dict()


def _stored(value) -> bytes:
    """`value` as Prefect's result store writes a task's result with `result_serializer="json"` (tasks/cache.py)."""
    return ResultRecord(
        result=value, metadata=ResultRecordMetadata(storage_key="k", serializer=JSONSerializer())
    ).serialize()


def test_the_record_round_trips_through_prefects_json_result_store():
    m = DataManifest.read(FIXTURES / "manifest.json")
    back = ResultRecord.deserialize(_stored(m)).result
    assert isinstance(back, DataManifest) and back == m  # the data-prep stage's cache hands back the record

    # a data-prep result stored by the previous release: a plain dict, which DataManifest.of reads
    old = ResultRecord.deserialize(_stored(json.loads((FIXTURES / "manifest.json").read_text()))).result
    assert type(old) is dict and DataManifest.of(old) == m
    assert DataManifest.of(m) is m


def test_a_manifest_without_a_key_is_one_error_saying_what_to_do(tmp_path):
    raw = json.loads((FIXTURES / "manifest.json").read_text())
    for key, where in (("splits", "splits"), ("hash", "hash"), ("tokenizer", "tokenizer")):
        path = tmp_path / f"no-{key}.json"
        path.write_text(json.dumps({k: v for k, v in raw.items() if k != key}))
        with pytest.raises(ManifestError, match=rf"{path}.*no '{where}'.*run data prep again"):
            DataManifest.read(path)
    path = tmp_path / "no-mask.json"
    path.write_text(json.dumps({**raw, "tokenizer": {k: v for k, v in raw["tokenizer"].items() if k != "mask_id"}}))
    with pytest.raises(ManifestError, match=r"no 'mask_id'.*delete that data folder"):
        DataManifest.read(path)
    with pytest.raises(ManifestError, match=r"stored data-prep result has no 'dir'"):
        DataManifest.of({"hash": "x"})


def test_a_manifest_of_an_unknown_kind_or_shape_is_refused(tmp_path):
    raw = json.loads((FIXTURES / "manifest.json").read_text())
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({**raw, "kind": "images"}))
    with pytest.raises(ManifestError, match=r"kind 'images' is not one of pretraining, instruction.*run data prep"):
        DataManifest.read(path)
    path.write_text(json.dumps({**raw, "splits": {"train": {**raw["splits"]["train"], "tokens": "many"}}}))
    with pytest.raises(ManifestError, match=r"is not a data manifest \(ValueError.*run data prep again"):
        DataManifest.read(path)
    path.write_text(json.dumps([raw]))
    with pytest.raises(ManifestError, match=r"holds a JSON list, not a data manifest"):
        DataManifest.read(path)


def test_a_file_that_is_not_json_or_not_there_says_what_to_do(tmp_path):
    half = tmp_path / "manifest.json"
    half.write_text((FIXTURES / "manifest.json").read_text()[:200])  # cut short
    with pytest.raises(ManifestError, match=r"manifest.json is not JSON .*delete that data folder and run data prep"):
        DataManifest.read(half)
    with pytest.raises(ManifestError, match=r"no data manifest at .*missing.json: .*run data prep \(difflm prep"):
        DataManifest.read(tmp_path / "missing.json")
    err = pytest.raises(ManifestError, DataManifest.read, tmp_path / "missing.json").value
    assert isinstance(err, UserError)  # the CLI prints it as one line, no traceback


def test_a_split_the_manifest_lacks_is_named():
    m = manifest_record(splits={"train": SplitStats(1, 10)})
    assert m.unique_tokens == 10
    with pytest.raises(ManifestError, match=r"no 'valid' split \(it has \['train'\]\)"):
        m.split("valid")
