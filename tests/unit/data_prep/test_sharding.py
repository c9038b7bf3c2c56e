"""Data prep by input: each task reads about 1/N of the input bytes, every record once, and the documents of
each split do not depend on N."""

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datatrove.utils.logging import setup_default_logger
from helpers import tiny_config
from megatron.core.datasets.indexed_dataset import IndexedDataset

import difflm.data_prep.columnar as columnar
from difflm.data_prep.pipeline import prepare_data
from difflm.data_prep.readers import make_reader
from difflm.data_prep.sharding import InputFile, plan
from difflm.manifest import DataManifest

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(autouse=True)
def _restore_loguru():
    """datatrove points loguru at this test's captured stderr: re-point it afterwards."""
    yield
    setup_default_logger()


def test_the_plan_gives_every_byte_to_one_task():
    files = [
        InputFile("a.jsonl", 1000, True),
        InputFile("b.jsonl.gz", 300, False),
        InputFile("c.jsonl", 0, True),
        InputFile("d.jsonl", 77, True),
        InputFile("e.parquet", 0, False),
    ]
    for n in range(1, 10):
        got: dict[str, list[tuple[int, int]]] = {f.path: [] for f in files}
        for rank in range(n):
            for p in plan(files, rank, n):
                got[p.path].append((p.start, p.end if p.end is not None else -1))
        for f in files:
            if f.splittable and f.size:  # contiguous ranges that cover the file, or the whole file once
                ranges = sorted(got[f.path])
                assert ranges == [(0, -1)] or (
                    ranges[0][0] == 0
                    and ranges[-1][1] == f.size
                    and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
                ), (n, ranges)
            else:
                assert got[f.path] == [(0, -1)], (n, f.path)
    assert plan(files, 0, 2) == plan(files, 0, 2)  # a function of names, sizes and N


def _awkward_jsonl(path: Path) -> list[str]:
    """Records of many lengths, blank lines, CRLF, a byte-order mark and a bad line: the texts to keep."""
    rng = np.random.default_rng(3)
    texts, lines = [], [b"\xef\xbb\xbf" + json.dumps({"text": "first"}).encode() + b"\n"]
    texts.append("first")
    for i in range(60):
        text = f"record {i} " + " ".join(rng.choice(WORDS, int(rng.integers(0, 40))))
        texts.append(text)
        end = b"\r\n" if i % 7 == 0 else b"\n"
        lines.append(json.dumps({"text": text}).encode() + end + (b"\n" if i % 11 == 0 else b""))
    lines.insert(30, b"{not json\n")
    path.write_bytes(b"".join(lines))
    return texts


def test_every_record_is_read_by_one_task_whatever_the_cut(tmp_path):
    texts = _awkward_jsonl(tmp_path / "docs.jsonl")
    size = (tmp_path / "docs.jsonl").stat().st_size
    for n in (1, 2, 3, 5, 8, 64, 300):
        seen, malformed, read = [], 0, []
        for rank in range(n):
            reader = make_reader(tmp_path / "docs.jsonl", "jsonl", "text", "docs")
            seen += [d.text for d in reader.run(None, rank, n)]
            malformed += reader.stats["skipped_malformed_json"].total
            read.append(reader.stats["read_bytes"].total)
        assert seen == texts, n  # the tasks in rank order give the file's order
        assert malformed == 1, n
        longest = max(len(line) for line in (tmp_path / "docs.jsonl").read_bytes().splitlines(keepends=True))
        assert max(read) <= size // n + longest + 1, (n, read)


def _per_task_read_bytes(out: Path) -> list[int]:
    counts = []
    for path in sorted((out / "logs" / "stats").glob("*.json")):
        counts.append(sum(s["stats"].get("read_bytes", {}).get("total", 0) for s in json.loads(path.read_text())))
    return counts


def _documents(manifest: DataManifest) -> dict[str, list[tuple[int, ...]]]:
    """The token ids of every document per split, sorted: what must not depend on the number of tasks."""
    docs = {}
    for split, s in manifest.splits.items():
        found = []
        for prefix in s.prefixes:
            ds = IndexedDataset(prefix)
            found += [tuple(np.asarray(ds[i]).tolist()) for i in range(len(ds))]
        docs[split] = sorted(found)
    return docs


def test_four_tasks_read_a_quarter_each_and_write_the_one_task_documents(tmp_path, tiny_manifest):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(5)
    big = [f"doc {i}: " + " ".join(rng.choice(WORDS, 40)) for i in range(400)]
    (src / "big.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in big) + "[1]\n")
    with gzip.open(src / "small.jsonl.gz", "wt") as f:  # a compressed file is read whole by one task
        f.writelines(json.dumps({"text": f"gz doc {i} " * 5}) + "\n" for i in range(30))
    (src / "tiny.jsonl").write_text(json.dumps({"text": "one more document"}) + "\n")
    total = sum(p.stat().st_size for p in src.iterdir())

    def run(workdir: Path, tasks: int) -> DataManifest:
        return prepare_data(
            tiny_config(
                workdir,
                f"tokenizer.path={tiny_manifest.tokenizer.path}",
                "data.max_documents=null",
                "data.min_chars=0",
                "data.valid_fraction=0.25",
                f"data.sources=[{src}]",
                f"data.tasks={tasks}",
                "data.workers=1",
            )
        )

    one, four = run(tmp_path / "one", 1), run(tmp_path / "four", 4)
    assert _per_task_read_bytes(Path(one.dir)) == [total]
    read = _per_task_read_bytes(Path(four.dir))
    assert len(read) == 4 and max(read) <= total / 3 and sum(read) < total + 4 * 200, (read, total)
    assert len(four.splits["train"].prefixes) == 4  # one shard per task
    assert _documents(four) == _documents(one)
    for split in ("train", "valid"):
        assert four.splits[split].documents == one.splits[split].documents > 0
        assert four.splits[split].tokens == one.splits[split].tokens
    assert four.skipped == one.skipped == {"skipped_not_an_object": 1}  # counted once, not per task


def test_a_parquet_text_over_the_limits_is_a_counted_skip(tmp_path, monkeypatch):
    monkeypatch.setattr(columnar, "MAX_RECORD_BYTES", 200)  # a.parquet's page is read: its values could fit
    monkeypatch.setattr(columnar, "_BATCH_TARGET", 1000)  # c.parquet's group is read in batches of 18 rows
    pq.write_table(pa.table({"text": ["short one", "x" * 500, "short two"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": ["y" * 5000]}), tmp_path / "b.parquet")  # a page over its one value
    pq.write_table(pa.table({"text": ["z" * 50] * 100}), tmp_path / "c.parquet", row_group_size=100)
    reader = make_reader(tmp_path, "parquet", "text", "p")
    texts = [d.text for d in reader.run()]
    assert texts == ["short one", "short two"] + ["z" * 50] * 100  # a many-row group, in batches
    assert reader.stats["skipped_oversize_record"].total == 2
