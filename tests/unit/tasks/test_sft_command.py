"""`difflm sft`'s parts that need no training: the held-out instruction items, the lines it prints, the lineage in
the registered version's description, the workdir of a source inside a run. The whole command, from a pretrained
test-tiny run to a registered tuned model: tests/integration/test_sft.py."""

from __future__ import annotations

import pytest
from helpers import manifest_record, tiny_config
from instruction_data import RESPONSE_IDS, START, write_instruction_data

from difflm.models.evaluation.instructions import NoInstructionItems, before_after_lines, instruction_items
from difflm.rundir import in_source_workdir
from difflm.tracking.registry import describe


def test_each_assistant_turn_is_an_item_with_the_conversation_before_it_as_prompt(tmp_path):
    manifest = write_instruction_data(tmp_path / "data", manifest_record(), documents=(4, 12))
    eos = manifest.tokenizer.eos_id
    items = instruction_items(manifest, limit=1000)
    conversations = [it for it in items if it["prompt"][0] == START]
    assert len(conversations) == len(items) >= 12  # every item starts at its conversation's start
    second_turns = [it for it in items if eos in it["prompt"]]  # a prompt holding an answer: a two-turn one's 2nd
    assert second_turns and len(items) == 12 + len(second_turns)
    for it in items:
        *answer, end = it["response"]
        assert end == eos and all(t in RESPONSE_IDS for t in answer)  # the response and the EOS closing it
        assert it["prompt"][-1] not in RESPONSE_IDS  # the prompt stops where the answer starts
    assert instruction_items(manifest, limit=5) == items[:5]


def test_text_data_has_no_instruction_items_and_says_which_kind_it_needs():
    with pytest.raises(NoInstructionItems, match="is pretraining data: .*data.kind=instruction"):
        instruction_items(manifest_record(), limit=8)


def test_the_lines_sft_prints_name_both_models():
    after = {"exact_match": 0.75, "nll_per_token": 0.4, "items": 48}
    before = {"exact_match": 0.0, "nll_per_token": 6.2, "items": 48}
    lines = before_after_lines(before, after)
    assert lines[0] == "held-out exact match: before 0.000  after 0.750  (48 items)"
    assert lines[1] == "held-out response NLL: before 6.200  after 0.400 nats/token"


def test_the_registered_description_names_the_pretrained_run(tmp_path):
    lineage = {
        "path": "/w/runs/r/hf",
        "sha256": "ab" * 32,
        "run_dir": "/w/runs/r",
        "mlflow_run_id": "0123abcd",
        "registered_version": "difflm-test-tiny-difflm-noshift-enwiki/1",
    }
    text = describe(
        tiny_config(tmp_path), links={"run": "runs:/x"}, checkpoint="/c", source="s", metrics={}, lineage=lineage
    )
    assert (
        "- trained from: run `/w/runs/r`, MLflow run `0123abcd`, registered version "
        "`difflm-test-tiny-difflm-noshift-enwiki/1`, files `/w/runs/r/hf` (sha256 abababababababab...)"
    ) in text
    assert "trained from" not in describe(
        tiny_config(tmp_path), links={"run": "r"}, checkpoint="c", source="s", metrics={}
    )


def test_a_source_inside_a_run_tunes_into_that_runs_workdir(tmp_path):
    run = tmp_path / "work" / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("name: test-tiny\n")
    assert in_source_workdir(str(run), ["train.train_iters=3"]) == [
        f"workdir={tmp_path / 'work'}",
        "train.train_iters=3",
    ]
    assert in_source_workdir(str(run), ["workdir=/elsewhere"]) == ["workdir=/elsewhere"]  # named: kept
    assert in_source_workdir("models:/m/1", []) == []
    assert in_source_workdir(str(tmp_path), []) == []  # not a run
