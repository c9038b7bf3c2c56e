"""Instruction data prep through datatrove: token shards and their loss-mask shards align, every bad record is
skipped, counted and named by kind (nothing lost), verify catches a mask that does not match its shard, a resumed
prep rewrites both files of an unfinished task, and `difflm prep` prepares the shipped tasks."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import tiny_config
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer

from difflm.data_prep.chat import ChatFormat
from difflm.data_prep.heldout import split_conversations
from difflm.data_prep.pipeline import prepare_data
from difflm.data_prep.verify import DataVerificationError, verify
from difflm.flows.cli import main
from difflm.manifest import DataManifest, loss_mask_prefix

EOS = "<|endoftext|>"


def _talk(i: int) -> list[dict]:
    return [{"role": "user", "content": f"copy: item {i}"}, {"role": "assistant", "content": f"item {i}"}]


def _cfg(tmp_path, tiny_manifest, *overrides):
    """Instruction configs on the demo tokenizer (no BPE training per test)."""
    return tiny_config(
        tmp_path,
        f"tokenizer.path={tiny_manifest.tokenizer.path}",
        "data.kind=instruction",
        "data.max_documents=null",
        "data.valid_fraction=0.25",
        *overrides,
    )


def _documents(manifest: DataManifest):
    """(tokens, mask) of every document of every shard."""
    for split in manifest.splits.values():
        for prefix in split.prefixes:
            tokens, masks = IndexedDataset(prefix), IndexedDataset(loss_mask_prefix(prefix))
            assert (tokens.sequence_lengths == masks.sequence_lengths).all()
            assert (tokens.document_indices == masks.document_indices).all()
            for k in range(len(tokens)):
                yield np.asarray(tokens[k]), np.asarray(masks[k])


def test_shards_and_masks_align_in_a_real_prep(tmp_path, tiny_manifest):
    (tmp_path / "in").mkdir()
    lines = [{"messages": _talk(i)} for i in range(12)]
    lines += [{"prompt": f"copy: pair {i}", "response": f"pair {i}", "system": "Be brief."} for i in range(6)]
    multi = [*_talk(100), {"role": "user", "content": "again: x"}, {"role": "assistant", "content": "x"}]
    lines.append({"messages": multi})
    (tmp_path / "in" / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    table = pa.table({"messages": [_talk(200 + i) for i in range(5)]})  # list<struct<role, content>>
    pq.write_table(table, tmp_path / "rows.parquet")
    m = prepare_data(_cfg(tmp_path, tiny_manifest, f"data.sources=[{tmp_path / 'in'}, {tmp_path / 'rows.parquet'}]"))
    assert m.kind == "instruction" and m.instruction["template"] == "plain" and m.loss_masks
    assert DataManifest.read(Path(m.dir) / "manifest.json") == m  # the template and the kind are written
    tok = Tokenizer.from_file(m.tokenizer.json_file)
    eos = m.tokenizer.eos_id
    answers = []
    for ids, mask in _documents(m):
        assert ids[-1] == eos and mask[-1] == 1  # each conversation ends with its last answer's EOS, scored
        assert set(np.unique(mask)) == {0, 1} and mask[0] == 0  # the prompt opens it, unscored
        scored = tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
        answers.append(scored)
        assert "User" not in scored and "Assistant" not in scored and "copy" not in scored
    assert len(answers) == 12 + 6 + 1 + 5 == m.splits["train"].documents + m.splits["valid"].documents
    assert f" item 100{EOS} x{EOS}" in answers  # multi-turn: both assistant turns scored
    assert {f" item {i}{EOS}" for i in range(12)} | {f" pair {i}{EOS}" for i in range(6)} <= set(answers)
    assert verify(m)["documents"] == 24 and m.skipped == {}


def test_bad_instruction_records_one_line_per_kind_nothing_lost(tmp_path, tiny_manifest, capsys):
    tok_dir = tmp_path / "tok"  # the demo tokenizer with a template that refuses one content
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text(Path(tiny_manifest.tokenizer.json_file).read_text())
    template = (
        "{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('boom is refused') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    good = [{"messages": _talk(i)} for i in range(8)]
    bad = [
        {"text": "no conversation"},
        {"messages": [{"role": "user", "content": "q"}]},
        {"prompt": "only a question"},
        {"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}]},
        {"messages": {"role": "user"}},
        {"prompt": "q", "response": "boom"},
    ]
    src = tmp_path / "mixed.jsonl"
    src.write_text(
        "".join(json.dumps(r) + "\n" for r in good[:4] + bad)
        + "{not json\n"
        + "".join(json.dumps(r) + "\n" for r in good[4:])
    )
    (tmp_path / "rows").mkdir()  # Parquet: a file without the conversation's columns, a row with an empty answer
    pq.write_table(pa.table({"text": ["a", "b", "c"]}), tmp_path / "rows" / "a.parquet")
    pq.write_table(pa.table({"prompt": ["q1", "q2"], "response": ["a1", " "]}), tmp_path / "rows" / "b.parquet")
    sources = f"data.sources=[{src}, {tmp_path / 'rows'}]"
    m = prepare_data(_cfg(tmp_path, tiny_manifest, sources, f"tokenizer.path={tok_dir}"))
    assert m.instruction["template"] == "tokenizer" and m.instruction["chat_template"] == template
    assert m.skipped == {
        "skipped_no_conversation": 1 + 3,
        "skipped_no_assistant_turn": 2,
        "skipped_unknown_role": 1,
        "skipped_empty_content": 1 + 1,
        "skipped_malformed_messages": 1,
        "skipped_template_error": 1,
        "skipped_malformed_json": 1,
    }
    kept = m.splits["train"].documents + m.splits["valid"].documents
    records = len(src.read_text().splitlines()) + 3 + 2
    assert kept == 8 + 1 and kept + sum(m.skipped.values()) == records  # nothing lost
    out = capsys.readouterr().out.splitlines()
    kinds = [line for line in out if line.startswith("data prep: skipped ")]
    assert len(kinds) == len(m.skipped)  # one line per kind, naming the first record of it and what to do
    lines = {line.split(": ")[2].split(",")[0]: line for line in kinds}
    assert f"the first at {src}:6 (1 turns, none of them the assistant's)" in lines["no assistant turn"]
    assert "count" not in lines and "robot" in lines["unknown role"] and "use the roles" in lines["unknown role"]
    assert (
        f"{src}:11 (the chat template failed" in lines["template error"]
        and "boom is refused" in lines["template error"]
    )
    rejects = sorted(p.name for p in (Path(m.dir) / "logs" / "rejects").glob("*.json"))
    assert len(rejects) == len(m.skipped) and all(r.startswith("00000-") for r in rejects)


def test_verify_catches_a_mask_shard_that_does_not_match(tmp_path, tiny_manifest):
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": _talk(i)}) + "\n" for i in range(10)))
    m = prepare_data(_cfg(tmp_path, tiny_manifest, f"data.sources=[{src}]"))
    mask = Path(loss_mask_prefix(m.splits["train"].prefixes[0]))
    idx, binary = mask.with_suffix(".idx"), Path(f"{mask}.bin")
    good_idx, good_bin = idx.read_bytes(), binary.read_bytes()
    other = prepare_data(_cfg(tmp_path, tiny_manifest, f"data.sources=[{src}]", "data.split_seed=7"))
    idx.write_bytes(Path(loss_mask_prefix(other.splits["train"].prefixes[0]) + ".idx").read_bytes())
    with pytest.raises(DataVerificationError, match="loss mask's .* do not match the token shard's.*delete"):
        verify(m)
    idx.write_bytes(good_idx)
    binary.write_bytes(good_bin[:-1])
    with pytest.raises(DataVerificationError, match="truncated or corrupt"):
        verify(m)
    binary.write_bytes(bytes([2]) + good_bin[1:])
    with pytest.raises(DataVerificationError, match="0 and 1 only"):
        verify(m)
    binary.unlink()
    with pytest.raises(DataVerificationError, match="the loss mask of .* is missing"):
        verify(m)
    binary.write_bytes(good_bin)
    assert verify(m)["documents"] == 10


def test_resume_after_a_kill_keeps_tokens_and_masks_consistent(tmp_path, tiny_manifest):
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": _talk(i)}) + "\n" for i in range(30)))
    cfg = _cfg(tmp_path, tiny_manifest, f"data.sources=[{src}]", "data.tasks=3")
    m = prepare_data(cfg)
    out = Path(m.dir)
    files = sorted(out.rglob("*_tokens*.*"))
    assert any("_loss_mask" in p.name for p in files)
    reference = {p: p.read_bytes() for p in files}
    # killed: task 1 never completed (no marker), its tokens written, its mask half-written; no manifest yet
    (out / "manifest.json").unlink()
    (out / "logs" / "completions" / "00001").unlink()
    for p in files:
        if p.name.startswith("00001_") and "_loss_mask" in p.name:
            p.write_bytes(p.read_bytes()[:3])
    again = prepare_data(cfg)
    assert {p: p.read_bytes() for p in files} == reference and again.splits == m.splits
    assert verify(again)["documents"] == 30


def test_difflm_prep_prepares_the_shipped_tasks(tmp_path, tiny_manifest, capsys):
    args = [f"workdir={tmp_path}", f"tokenizer.path={tiny_manifest.tokenizer.path}", "data.kind=instruction"]
    assert main(["prep", *args, "data.sources=[demo:instructions]", "data.max_documents=null"]) == 0
    out = capsys.readouterr().out
    assert "data prep: 2000 documents kept" in out and "instructions" in out
    m = DataManifest.read(next((tmp_path / "data").glob("*/manifest.json")))
    assert m.kind == "instruction" and m.sources[0]["origin"].startswith("generated by difflm")
    assert m.splits["valid"].documents > 50  # held-out items (5%: the default split), by the hash of each item
    lengths = [len(ids) for ids, _ in _documents(m)]
    assert max(lengths) <= 64 and np.median(lengths) <= 24  # a conversation fits the tiny model's windows
    # the held-out conversations, read again as conversations: exactly the valid split's documents
    held_out = list(split_conversations(m, "valid"))
    chat = ChatFormat.of(m)
    valid = IndexedDataset(m.splits["valid"].prefixes[0])
    assert [chat.encode(c)[0] for c in held_out] == [np.asarray(valid[k]).tolist() for k in range(len(valid))]
    assert all(c[-1]["role"] == "assistant" for c in held_out) and any(len(c) == 4 for c in held_out)
