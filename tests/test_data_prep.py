import json

import numpy as np
import pytest

from conftest import tiny_config
from data_prep.pipeline import DataPrepError, data_dir, prepare_data
from data_prep.split import split_of
from data_prep.tokenizer import TokenizerError


def test_manifest_matches_written_shards(tiny_manifest):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = tiny_manifest["tokenizer"]
    assert tok["vocab_size"] == 512 and tok["mask_id"] != tok["eos_id"]
    for split in ("train", "valid"):
        s = tiny_manifest["splits"][split]
        assert s["documents"] > 0 and s["data_path"].startswith("1.0 ")
        ds = IndexedDataset(s["prefixes"][0])
        assert len(ds) == s["documents"] and int(ds.sequence_lengths.sum()) == s["tokens"]
        doc = np.asarray(ds[0])
        assert doc[-1] == tok["eos_id"]  # EOS appended to every document
        assert doc.max() < tok["vocab_size"] and tok["mask_id"] not in doc
    assert tiny_manifest["splits"]["train"]["documents"] + tiny_manifest["splits"]["valid"]["documents"] == 40


def test_split_is_a_stable_function_of_text():
    texts = [f"document number {i}" for i in range(2000)]
    first = [split_of(t, 0.1, 0) for t in texts]
    assert first == [split_of(t, 0.1, 0) for t in reversed(texts)][::-1]
    assert 0.07 < first.count("valid") / len(texts) < 0.13
    assert first != [split_of(t, 0.1, 1) for t in texts]  # the salt reshuffles


def test_rerun_reuses_and_leftovers_are_redone(session_dir, tiny_manifest):
    cfg = tiny_config(session_dir / "shared")
    manifest_file = data_dir(cfg) / "manifest.json"
    mtime = manifest_file.stat().st_mtime_ns
    assert prepare_data(cfg) == tiny_manifest and manifest_file.stat().st_mtime_ns == mtime

    other = tiny_config(session_dir / "leftover", "data.max_documents=12", "data.valid_fraction=0.2")
    out = data_dir(other)
    (out / "train").mkdir(parents=True)
    (out / "train" / "00000_tokens.bin").write_bytes(b"half-written")  # an interrupted earlier run
    manifest = prepare_data(other)
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["valid"]["documents"] == 12


def test_missing_input_path_is_a_clear_error(tmp_path):
    cfg = tiny_config(tmp_path, f"data.inputs=[{tmp_path / 'nope.jsonl'}]")
    with pytest.raises(DataPrepError, match="does not exist"):
        prepare_data(cfg)


def test_folder_without_jsonl_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = tiny_config(tmp_path, f"data.inputs=[{tmp_path / 'empty'}]")
    with pytest.raises(DataPrepError, match="no .jsonl"):
        prepare_data(cfg)


def test_user_jsonl_and_tokenizer_without_mask_token(tmp_path, tiny_manifest):
    from tokenizers import Tokenizer

    src = tmp_path / "docs.jsonl"
    rows = [{"content": f"Paragraph {i}. " + "Some real words here. " * 30} for i in range(30)]
    src.write_text("\n".join(json.dumps(r) for r in rows))
    # a tokenizer lacking the mask token: remove it by training one without it
    from tokenizers import models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([r["content"] for r in rows], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = tiny_config(tmp_path, f"data.inputs=[{src}]", "data.text_key=content",
                      f"tokenizer.path={tmp_path / 'tokenizer.json'}")
    with pytest.raises(TokenizerError, match=r"no mask_token '<\|mask\|>'.*add_special_tokens"):
        prepare_data(cfg)

    # the same data with a tokenizer that has every special token works, from a user JSONL
    cfg_ok = tiny_config(tmp_path / "ok", f"data.inputs=[{src}]", "data.text_key=content", "data.valid_fraction=0.3",
                         f"tokenizer.path={tiny_manifest['tokenizer']['path']}")
    m = prepare_data(cfg_ok)
    assert m["tokenizer"]["sha256"] == tiny_manifest["tokenizer"]["sha256"]
    assert m["splits"]["train"]["documents"] + m["splits"]["valid"]["documents"] == 30
