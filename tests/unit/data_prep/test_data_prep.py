"""data_prep: every reader, stable splits, resume byte-identity, verification, bad input."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import tiny_config
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer

from difflm.data_prep.pipeline import DataPrepError, data_dir, prepare_data
from difflm.data_prep.split import split_of
from difflm.data_prep.tokenizer import TokenizerError
from difflm.data_prep.verify import DataVerificationError, verify
from difflm.manifest import DataManifest

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _docs(n: int, tag: str) -> list[str]:
    rng = np.random.default_rng(len(tag))
    return [f"{tag} document {i}. " + " ".join(rng.choice(WORDS, 60)) for i in range(n)]


def _cfg(tmp_path, tiny_manifest, *overrides):
    """Small user-data configs reuse the demo tokenizer (no BPE training per test)."""
    return tiny_config(
        tmp_path,
        f"tokenizer.path={tiny_manifest.tokenizer.path}",
        "data.min_chars=0",
        "data.valid_fraction=0.25",
        *overrides,
    )


def test_manifest_matches_written_shards(tiny_manifest):
    tok = tiny_manifest.tokenizer
    assert tok.vocab_size == 512 and tok.mask_id != tok.eos_id and tiny_manifest.token_bytes == 2
    for split in ("train", "valid"):
        s = tiny_manifest.splits[split]
        assert s.documents > 0 and s.data_path.startswith("1 ")
        ds = IndexedDataset(s.prefixes[0])
        assert len(ds) == s.documents == s.sources["enwiki"]["documents"]
        assert int(ds.sequence_lengths.sum()) == s.tokens
        doc = np.asarray(ds[0])
        assert doc[-1] == tok.eos_id  # EOS appended to every document
        assert doc.max() < tok.vocab_size and tok.mask_id not in doc
    assert tiny_manifest.splits["train"].documents + tiny_manifest.splits["valid"].documents == 40
    assert verify(tiny_manifest)["documents"] == 40
    assert (
        tiny_manifest.sources[0]["license"].startswith("CC BY-SA") and "gensim" in tiny_manifest.sources[0]["carrier"]
    )


def test_split_is_a_stable_function_of_text():
    texts = [f"document number {i}" for i in range(3000)]
    first = [split_of(t, 0.1, 0, 0.1) for t in texts]
    assert first == [split_of(t, 0.1, 0, 0.1) for t in reversed(texts)][::-1]
    assert 0.07 < first.count("valid") / len(texts) < 0.13 and 0.07 < first.count("test") / len(texts) < 0.13
    assert first != [split_of(t, 0.1, 1, 0.1) for t in texts]  # the salt reshuffles


def _split_texts(manifest: DataManifest, tokenizer_path) -> dict[str, set[str]]:
    tok = Tokenizer.from_file(str(Path(tokenizer_path) / "tokenizer.json"))
    out = {}
    for split, s in manifest.splits.items():
        texts = set()
        for prefix in s.prefixes:
            ds = IndexedDataset(prefix)
            texts |= {tok.decode(np.asarray(ds[i])[:-1].tolist()) for i in range(len(ds))}
        out[split] = texts
    return out


def test_every_reader_and_blending(tmp_path, tiny_manifest):
    """JSONL.gz, Parquet, a .txt folder and a saved HF dataset, in one run, with blend weights."""
    src = tmp_path / "src"
    src.mkdir()
    with gzip.open(src / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": t}) + "\n" for t in _docs(12, "jsonl"))
    pq.write_table(pa.table({"content": _docs(10, "parquet")}), src / "b.parquet")
    (src / "txt").mkdir()
    for i, t in enumerate(_docs(8, "text")):
        (src / "txt" / f"{i}.txt").write_text(t)
    datasets.Dataset.from_dict({"text": _docs(9, "hfdisk")}).save_to_disk(str(src / "hf"))
    sources = (
        f"data.sources=[{{path: {src / 'a.jsonl.gz'}, text_key: body, weight: 3}}, "
        f"{{path: {src / 'b.parquet'}, text_key: content}}, {{path: {src / 'txt'}}}, "
        f"{{path: {src / 'hf'}, name: hfdisk}}]"
    )
    m = prepare_data(_cfg(tmp_path, tiny_manifest, sources))
    fmts = {s["name"]: s["format"] for s in m.sources}
    assert fmts == {"a": "jsonl", "b": "parquet", "txt": "text", "hfdisk": "hf_disk"}
    per = {k: m.splits["train"].sources[k]["documents"] + m.splits["valid"].sources[k]["documents"] for k in fmts}
    assert per == {"a": 12, "b": 10, "txt": 8, "hfdisk": 9}
    w = dict(zip((Path(p).parent.name for p in m.splits["train"].prefixes), m.splits["train"].weights))
    assert w["a"] == pytest.approx(3 * w["b"]) and sum(w.values()) == pytest.approx(1.0)
    texts = _split_texts(m, m.tokenizer.path)
    assert any(t.startswith("parquet document") for t in texts["train"] | texts["valid"])


def test_splits_do_not_depend_on_worker_count(tmp_path, tiny_manifest):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(40, "w")))
    one = prepare_data(_cfg(tmp_path / "one", tiny_manifest, f"data.sources=[{src}]"))
    two = prepare_data(_cfg(tmp_path / "two", tiny_manifest, f"data.sources=[{src}]", "data.workers=2"))
    assert len(two.splits["train"].prefixes) == 2  # one shard per task
    tr = two.splits["train"]
    tokens = [tr.sources["docs"]["tokens"] * w for w in tr.weights]  # no weights set: mix by size
    shards = [IndexedDataset(p) for p in tr.prefixes]  # keep them alive: their arrays are views of an mmap
    assert tokens == pytest.approx([int(d.sequence_lengths.sum()) for d in shards])
    assert _split_texts(one, one.tokenizer.path) == _split_texts(two, two.tokenizer.path)


# each task its share of the input bytes (the default), or every task every record (max_documents needs it)
@pytest.mark.parametrize("reading", ["data.max_documents=null", "data.max_documents=40"], ids=["by-input", "all"])
def test_resume_finishes_only_missing_tasks_byte_identically(tmp_path, tiny_manifest, reading):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(40, "r")))
    cfg = _cfg(tmp_path, tiny_manifest, f"data.sources=[{src}]", "data.tasks=3", "data.workers=1", reading)
    m = prepare_data(cfg)
    out = Path(m.dir)
    files = sorted(p for p in out.rglob("*_tokens.*"))
    reference = {p: p.read_bytes() for p in files}
    # interruption: task 1 never completed (no marker, half-written shards), no manifest yet
    (out / "manifest.json").unlink()
    (out / "logs" / "completions" / "00001").unlink()
    for p in files:
        if p.name.startswith("00001_"):
            p.write_bytes(p.read_bytes()[:10])
    untouched = {p: p.stat().st_mtime_ns for p in files if not p.name.startswith("00001_")}
    again = prepare_data(cfg)
    assert {p: p.read_bytes() for p in files} == reference
    assert {p: p.stat().st_mtime_ns for p in untouched} == untouched  # finished tasks were not redone
    assert again.splits == m.splits
    # a finished prep is reused as is
    assert prepare_data(cfg) == again


def test_changed_config_writes_a_new_folder(tmp_path, tiny_manifest):
    a = _cfg(tmp_path, tiny_manifest)
    b = _cfg(tmp_path, tiny_manifest, "data.dedup=true")
    assert data_dir(a) != data_dir(b)


def test_verification_catches_corruption(tmp_path, tiny_manifest):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(20, "v")))
    m = prepare_data(_cfg(tmp_path, tiny_manifest, f"data.sources=[{src}]"))
    prefix = m.splits["train"].prefixes[0]
    binary = Path(prefix + ".bin")
    good = binary.read_bytes()
    binary.write_bytes(good[:-2])  # truncated
    with pytest.raises(DataVerificationError, match="truncated or corrupt.*delete"):
        verify(m)
    tokens = np.frombuffer(good, np.uint16).copy()
    tokens[5] = 60000  # outside the 512-token vocabulary
    binary.write_bytes(tokens.tobytes())
    with pytest.raises(DataVerificationError, match="outside the vocabulary"):
        verify(m)
    binary.write_bytes(good)
    bad_counts = m.to_dict()
    bad_counts["splits"]["train"]["sources"]["docs"]["documents"] += 1
    with pytest.raises(DataVerificationError, match="the manifest says"):
        verify(DataManifest.from_dict(bad_counts))
    assert verify(m)["documents"] == 20


def _shard_tokens(manifest: DataManifest) -> np.ndarray:
    width = np.uint16 if manifest.token_bytes == 2 else np.int32
    prefixes = [p for s in manifest.splits.values() for p in s.prefixes]
    return np.concatenate([np.fromfile(p + ".bin", width) for p in prefixes])


def test_the_mask_token_never_enters_the_clean_data(tmp_path, tiny_manifest):
    mask = tiny_manifest.tokenizer.mask_id
    texts = [t + (" cell <|mask|> out" if i % 2 else "") for i, t in enumerate(_docs(20, "m"))]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    m = prepare_data(_cfg(tmp_path, tiny_manifest, f"data.sources=[{src}]"))
    tokens = _shard_tokens(m)
    assert mask not in tokens and m.splits["train"].documents + m.splits["valid"].documents == 20
    prefix = m.splits["train"].prefixes[0]  # a shard with the mask id in it is refused, with the count
    binary = Path(prefix + ".bin")
    tokens = np.fromfile(binary, np.uint16)
    tokens[[3, 7]] = mask
    binary.write_bytes(tokens.tobytes())
    with pytest.raises(DataVerificationError, match=f"mask token id {mask} occurs 2 times.*delete"):
        verify(m)


def test_bad_records_are_counted_skips(tmp_path, tiny_manifest):
    good = _docs(12, "ok")
    lines = [json.dumps({"text": t}).encode() for t in good]
    lines += [
        b'{"text": "truncated',
        b'["not", "an object"]',
        b'{"title": "no text"}',
        b'{"text": "   \\n "}',
        '{"text": "caf\u00e9"}'.encode("latin-1"),
        json.dumps({"text": good[0]}).encode(),
        b"",
    ]
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    m = prepare_data(_cfg(tmp_path, tiny_manifest, f"data.sources=[{src}]", "data.dedup=true"))
    assert m.skipped == {
        "skipped_malformed_json": 1,
        "skipped_not_an_object": 1,
        "skipped_missing_text": 1,
        "skipped_invalid_utf8": 1,
        "dropped_empty": 1,
        "dropped_duplicate": 1,
    }
    assert m.splits["train"].documents + m.splits["valid"].documents == 12


def test_cleaning_steps_are_counted(tmp_path, tiny_manifest):
    texts = ["Cafe\u0301 " + "x" * 50, "short", "y" * 5000] + _docs(10, "c")
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    m = prepare_data(
        _cfg(
            tmp_path,
            tiny_manifest,
            f"data.sources=[{src}]",
            "data.min_chars=20",
            "data.max_chars=2000",
            "data.unicode_normalization=NFC",
        )
    )
    assert m.skipped == {"normalized": 1, "dropped_too_short": 1, "dropped_too_long": 1}


def test_rerun_reuses_and_leftovers_resume(session_dir, tiny_manifest):
    cfg = tiny_config(session_dir / "shared")
    manifest_file = data_dir(cfg) / "manifest.json"
    mtime = manifest_file.stat().st_mtime_ns
    assert prepare_data(cfg) == tiny_manifest and manifest_file.stat().st_mtime_ns == mtime


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda p: p / "nope.jsonl", "does not exist"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "no .jsonl"),
        (lambda p: (p / "x.csv").write_text("a,b") and p / "x.csv", "unknown format"),
    ],
)
def test_bad_paths_are_clear_errors(tmp_path, tiny_manifest, make, fragment):
    path = make(tmp_path)
    with pytest.raises(DataPrepError, match=fragment):
        prepare_data(_cfg(tmp_path, tiny_manifest, f"data.sources=[{path}]"))


def test_everything_filtered_says_what_happened(tmp_path, tiny_manifest):
    src = tmp_path / "junk.jsonl"
    src.write_text('{"text": ""}\n{"nope": 1}\n')
    with pytest.raises(DataPrepError, match=r"split is empty.*skipped_missing_text"):
        prepare_data(_cfg(tmp_path, tiny_manifest, f"data.sources=[{src}]"))


def test_tokenizer_without_mask_token_and_unloadable(tmp_path, tiny_manifest):
    # here, not at the top: tokenizers' `models` would shadow this project's `models` package in the module
    from tokenizers import models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(_docs(20, "t"), trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(10, "d")))
    cfg = tiny_config(tmp_path, f"data.sources=[{src}]", f"tokenizer.path={tmp_path / 'tokenizer.json'}")
    with pytest.raises(TokenizerError, match=r"no mask_token '<\|mask\|>'.*add_special_tokens"):
        prepare_data(cfg)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    cfg = tiny_config(tmp_path / "b", f"data.sources=[{src}]", f"tokenizer.path={tmp_path / 'broken'}")
    with pytest.raises(TokenizerError, match="could not load tokenizer"):
        prepare_data(cfg)
    cfg = tiny_config(tmp_path / "c", f"data.sources=[{src}]", f"tokenizer.path={tmp_path / 'nowhere'}")
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        prepare_data(cfg)


# A data prep in a process of its own, as from a terminal: under pytest's capture, loguru sinks and datatrove's
# fork server keep the streams of whichever test started them.
PREP = """
import sys
from difflm.data_prep.pipeline import prepare_data
from difflm.config import load_config
prepare_data(load_config("test-tiny", sys.argv[1:]))
"""


@pytest.mark.parametrize("workers, tokenizer", [(1, "given"), (2, "given"), (1, "trained")])
def test_terminal_shows_no_per_file_lines_and_the_stats_once(tmp_path, tiny_manifest, workers, tokenizer):
    """datatrove's per-file "Reading input file" lines and each task's stats go to the task logs only; the merged
    stats print once; a bad record's warning and the progress stay on the terminal. Also when a tokenizer is
    trained first, on a pass over the inputs in this process (outside the executor's task logs)."""
    src = tmp_path / "txt"
    src.mkdir()
    for i, t in enumerate(_docs(12, "quiet")):
        (src / f"{i:02d}.txt").write_text(t)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": _docs(1, "ok")[0]}) + "\n{not json\n")
    overrides = [
        f"workdir={tmp_path}",
        f"tokenizer.path={tiny_manifest.tokenizer.path}" if tokenizer == "given" else "tokenizer.vocab_size=300",
        "data.min_chars=0",
        "data.valid_fraction=0.25",
        f"data.sources=[{src}, {bad}]",
        f"data.workers={workers}",
    ]
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", PREP, *overrides], capture_output=True, text=True, cwd=root, env=env, timeout=300
    )
    err = out.stdout + out.stderr
    assert out.returncode == 0, err[-3000:]
    assert "Reading input file" not in err
    assert err.count("Stats: All") == 1 and err.count("\U0001f4c9 Stats") == 1, err[-3000:]  # the merged block
    assert "skipping record" in err  # warnings still reach the terminal
    # progress: the readers' bar with one worker, datatrove's task count with several
    assert "Document progress" in err if workers == 1 else f"{workers}/{workers} tasks completed" in err
    logs = "".join(p.read_text() for p in tmp_path.rglob("logs/task_*.log"))
    assert logs.count("Reading input file") >= 13 and "Stats: Task" in logs  # nothing lost: it is in the files


PREP_IMPORTS = """
import json, sys
from difflm.config import load_config
from difflm.data_prep.pipeline import prepare_data
m = prepare_data(load_config("test-tiny", [f"workdir={sys.argv[1]}", f"tokenizer.path={sys.argv[2]}"]))
print(json.dumps({"tokens": m.splits["train"].tokens, "heavy": sorted(n for n in sys.modules if n.startswith("megatron"))}))
"""


def test_data_prep_counts_its_shards_without_importing_megatron(tmp_path, tiny_manifest):
    """The manifest's counts come from the .idx files (difflm.data_prep.verify.read_index), not from megatron-core's
    reader, whose import alone cost seconds per prep (benchmarks/data_prep_throughput.py, x4 demo corpus: 39%
    of the tokenizer's speed with it, 75% without). The counts still equal megatron's."""
    proc = subprocess.run(
        [sys.executable, "-c", PREP_IMPORTS, str(tmp_path), tiny_manifest.tokenizer.path],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["heavy"] == [], f"data prep imported {out['heavy'][:5]}"
    manifest = DataManifest.read(next(tmp_path.glob("data/*/manifest.json")))
    shards = [IndexedDataset(p) for p in manifest.splits["train"].prefixes]  # alive: views of an mmap
    assert out["tokens"] == sum(int(s.sequence_lengths.sum()) for s in shards) > 0
    assert manifest.splits["train"].documents == sum(len(s) for s in shards)
