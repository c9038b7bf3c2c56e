"""Parquet and Arrow inputs are read in bounded memory whatever their shape (issue 50, item 2): a huge value in a
row group of several rows or in a nested column, a dictionary value that repeats, a saved HF dataset (Arrow).
Each file is written by one process and read by another, whose own peak RSS is measured (VmHWM)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from difflm.data_prep.columnar import _lengths
from difflm.data_prep.parquet_pages import pages
from difflm.data_prep.readers import make_reader

ROOT = Path(__file__).resolve().parents[3]
HUGE = 512 << 20

_WRITE = """
import sys
import numpy as np, pyarrow as pa, pyarrow.parquet as pq

shape, out = sys.argv[1], sys.argv[2]
HUGE = 512 << 20


def huge_and(small):
    # one text of HUGE bytes (zero pages: nothing to fill), then `small` texts
    data = np.zeros(HUGE + sum(len(s) for s in small), np.uint8)
    offsets, pos = [0, HUGE], HUGE
    for s in small:
        data[pos : pos + len(s)] = np.frombuffer(s.encode(), np.uint8)
        pos += len(s)
        offsets.append(pos)
    buffers = [None, pa.py_buffer(np.array(offsets, np.int64)), pa.py_buffer(data)]
    return pa.Array.from_buffers(pa.large_string(), len(offsets) - 1, buffers)


if shape == "two_row_group":  # the huge text and a small one in one group, then a group of good ones
    text = pa.concat_arrays([huge_and(["beside the huge one"]), pa.array(["after one", "after two"], pa.large_string())])
    pq.write_table(pa.table({"text": text}), out, row_group_size=2, compression="lz4", write_statistics=False)
elif shape == "nested":  # list<string>: the huge text inside a list
    values = huge_and(["small"])
    text = pa.LargeListArray.from_arrays(pa.array([0, 1, 2], pa.int64()), values)
    pq.write_table(pa.table({"text": text}), out, compression="lz4", write_statistics=False)
elif shape.startswith("dictionary"):  # one 30 MiB text, dictionary-encoded: a KiB file that expands to GB
    rows = int(shape.split("_")[1])
    text = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)), pa.array(["d" * (30 << 20)]))
    # without the stored Arrow schema the column reads back as plain strings: each row is the whole text
    pq.write_table(pa.table({"text": text}), out, compression="zstd", write_statistics=False, store_schema=False)
elif shape == "hf_disk":  # a saved HF dataset: Arrow IPC streams, one batch per `writer_batch_size` rows
    schema = pa.schema([("text", pa.large_string())])
    with pa.OSFile(out, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.record_batch([pa.array(["before"], pa.large_string())], schema=schema))
        writer.write_batch(pa.record_batch([huge_and(["beside the huge one"])], schema=schema))
        writer.write_batch(pa.record_batch([pa.array(["after"], pa.large_string())], schema=schema))
"""

_READ = """
import json, re, sys
from pathlib import Path
from difflm.data_prep.readers import make_reader
path, fmt, cap = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
reader = make_reader(path, fmt, "text", "bomb")
if cap:
    reader.max_file_bytes = cap
docs = [(len(d.text), d.text[:20]) for d in reader.run()]
peak_mb = int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024
stats = {k: v.total for k, v in reader.stats.stats.items() if k.startswith("skipped_")}
print(json.dumps({"docs": docs, "skipped": stats, "peak_mb": peak_mb}))
"""


def _limit_memory():
    """The reader may not take the machine down while it fails: 6 GiB of address space."""
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


def _read(path: Path, fmt: str, cap: int = 0) -> tuple[dict, str]:
    out = subprocess.run(
        [sys.executable, "-c", _READ, str(path), fmt, str(cap)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=_limit_memory,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print("peak RSS MiB", result["peak_mb"])
    return result, out.stderr


def _write(shape: str, path: Path) -> Path:
    subprocess.run([sys.executable, "-c", _WRITE, shape, str(path)], check=True, timeout=300)
    return path


@pytest.mark.integration  # two processes: the writer's memory must not count, the reader's peak is measured
def test_a_huge_text_in_a_row_group_of_several_rows_is_skipped_in_bounded_memory(tmp_path):
    path = _write("two_row_group", tmp_path / "two.parquet")
    assert path.stat().st_size < 4 << 20
    result, err = _read(path, "parquet")
    # the group holding the huge text is not read: its rows are counted, the next group is read as ever
    assert [text for _, text in result["docs"]] == ["after one", "after two"], result
    assert result["skipped"] == {"skipped_oversize_record": 2}, result
    assert result["peak_mb"] < 400, result
    assert "two.parquet row 0: oversize record" in err


@pytest.mark.integration
def test_a_huge_text_in_a_nested_list_column_is_skipped_in_bounded_memory(tmp_path):
    path = _write("nested", tmp_path / "nested.parquet")
    assert path.stat().st_size < 4 << 20
    result, err = _read(path, "parquet")
    assert result["docs"] == [] and result["skipped"] == {"skipped_non_string_text": 2}, result
    assert result["peak_mb"] < 400, result
    assert "nested.parquet row 0: non string text" in err


@pytest.mark.integration
def test_a_repeated_dictionary_value_is_read_one_copy_at_a_time(tmp_path):
    """1.4 KiB of Parquet, one 30 MiB text repeated 100 times: 3 GB of text, each a document within the limit,
    read one at a time (it held 26 copies at once, twice over: 3.5 GB)."""
    path = _write("dictionary_100", tmp_path / "dict.parquet")
    assert path.stat().st_size < 4 << 10
    result, _ = _read(path, "parquet")
    assert result["docs"] == [[30 << 20, "d" * 20]] * 100 and result["skipped"] == {}, result["skipped"]
    assert result["peak_mb"] < 400, result


@pytest.mark.integration
def test_repeated_dictionary_values_count_as_what_they_expand_to(tmp_path):
    """1000 copies of the 30 MiB text (MemoryError at 4.3 GB) under a 1 GiB cap per file: the copies before the
    cap are read, the rest of the file is one counted skip, as for a compressed JSONL file past the cap."""
    path = _write("dictionary_1000", tmp_path / "dict.parquet")
    result, err = _read(path, "parquet", cap=1 << 30)
    assert len(result["docs"]) == (1 << 30) // (30 << 20) == 34, len(result["docs"])
    assert result["skipped"] == {"skipped_oversize_file": 1}, result
    assert result["peak_mb"] < 400, result
    assert "skipping file dict.parquet: oversize file" in err


@pytest.mark.integration
def test_a_huge_document_in_a_saved_hf_dataset_is_skipped_in_bounded_memory(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "state.json").write_text("{}")
    _write("hf_disk", folder / "data-00000-of-00001.arrow")
    result, err = _read(folder, "hf_disk")
    assert [text for _, text in result["docs"]] == ["before", "beside the huge one", "after"], result
    assert result["skipped"] == {"skipped_oversize_record": 1}, result
    assert result["peak_mb"] < 400, result
    assert "data-00000-of-00001.arrow row 1: oversize record" in err


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"use_dictionary": False, "compression": "zstd", "write_statistics": True, "write_page_index": True},
        {"use_dictionary": False, "data_page_version": "2.0", "column_encoding": {"text": "DELTA_BYTE_ARRAY"}},
    ],
    ids=["dictionary", "statistics", "v2-delta"],
)
def test_page_headers_give_every_pages_size_and_values(tmp_path, options):
    texts = [f"document {i} " * (i % 50) for i in range(20000)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "a.parquet", data_page_size=64 << 10, **options)
    chunk = pq.ParquetFile(tmp_path / "a.parquet").metadata.row_group(0).column(0)
    with open(tmp_path / "a.parquet", "rb") as f:
        found = pages(f, chunk)
    data = found[1:] if chunk.has_dictionary_page else found
    assert len(data) > 3 and sum(values for _, values in data) == 20000, found
    assert max(size for size, _ in found) < chunk.total_uncompressed_size


def test_long_documents_in_pyarrows_large_pages_read_as_ever(tmp_path):
    """pyarrow writes 1024 values to a page whatever their size: 70 documents of 1 MiB make one 70 MiB page,
    which holds no value over the limit and is read whole, as before."""
    texts = [f"{i:02d}" * (1 << 19) for i in range(70)] + ["short"]  # distinct: no dictionary
    pq.write_table(pa.table({"text": texts}), tmp_path / "long.parquet")
    chunk = pq.ParquetFile(tmp_path / "long.parquet").metadata.row_group(0).column(0)
    with open(tmp_path / "long.parquet", "rb") as f:
        assert max(size for size, _ in pages(f, chunk)) > 70 << 20
    reader = make_reader(tmp_path / "long.parquet", "parquet", "text", "p")
    assert [d.text for d in reader.run()] == texts
    assert not [k for k in reader.stats.stats if k.startswith("skipped_")]


def test_value_lengths_come_from_the_offsets_for_every_string_layout():
    values = ["ab", None, "c" * 20, "d"]
    dictionary = pa.DictionaryArray.from_arrays(pa.array([0, None, 1, 2]), pa.array(["ab", "c" * 20, "d"]))
    for array in (pa.array(values), pa.array(values, pa.large_string()), pa.array(values, pa.string_view())):
        assert _lengths(array) == [2, None, 20, 1] and _lengths(array.slice(1)) == [None, 20, 1], array.type
    assert _lengths(dictionary) == [2, None, 20, 1]  # a dictionary value counts for every row that repeats it
