"""Data prep loses nothing it can read: a corpus of bad records and damaged files next to good records
whose texts are known, strict mode, and a prep killed with SIGKILL then resumed."""

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datatrove.utils.logging import setup_default_logger
from helpers import tiny_config
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer

from difflm.data_prep.pipeline import DataPrepError, data_dir, prepare_data
from difflm.data_prep.readers import make_reader
from difflm.manifest import DataManifest

ROOT = Path(__file__).resolve().parents[3]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(autouse=True)
def _restore_loguru():
    """datatrove points loguru at the sys.stderr of the moment (pytest's capture of this test): re-point it
    afterwards, so that later tests do not log into a closed capture."""
    yield
    setup_default_logger()


class Corpus:
    """Files of one source folder, the texts the prep must keep and the counts it must report."""

    def __init__(self, root: Path):
        self.root = root
        self.texts: set[str] = set()
        self.skipped: dict[str, int] = {}
        self.problem_files: list[str] = []
        self._n = 0

    def good(self, tag: str) -> str:
        """A unique text that survives every filter."""
        self._n += 1
        rng = np.random.default_rng(self._n)
        text = f"{tag} record {self._n}: " + " ".join(rng.choice(WORDS, 30))
        self.texts.add(text)
        return text

    def expect(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n

    def write(self, name: str, data: bytes) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def damaged(self, name: str, data: bytes) -> None:
        self.write(name, data)
        self.expect("skipped_damaged_file")
        self.problem_files.append(name)


def _line(text: str) -> bytes:
    return json.dumps({"text": text}).encode() + b"\n"


def _cut_off(compress) -> bytes:
    """The first half of one compressed record that does not compress away (hex of random bytes): the
    record cannot be complete, whatever the codec's block layout."""
    data = compress(_line("lost " + np.random.default_rng(7).bytes(3000).hex()))
    return data[: len(data) // 2]


def _zst(data: bytes) -> bytes:
    """One zstd frame (pyarrow's codec: the `zstandard` package is not a dependency)."""
    buf = pa.BufferOutputStream()
    with pa.CompressedOutputStream(buf, "zstd") as f:
        f.write(data)
    return buf.getvalue().to_pybytes()


def _parquet(table: pa.Table) -> bytes:
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    return buf.getvalue().to_pybytes()


def _jsonl_folder(c: Corpus) -> None:
    g = c.good
    c.write("good.jsonl", b"".join(_line(g("plain")) for _ in range(3)))
    c.write("sub/nested.jsonl", _line(g("nested")))
    c.write("bom.jsonl", b"\xef\xbb\xbf" + _line(g("bom")) + _line(g("bom")))  # the first record is kept
    c.write("crlf.jsonl", _line(g("crlf")).replace(b"\n", b"\r\n") + _line(g("crlf")).replace(b"\n", b"\r\n"))
    # NUL as a JSON escape and as a raw byte inside the string (invalid JSON, but readable): removed
    a, b = g("nul escaped"), g("nul raw")
    c.texts -= {a, b}
    c.texts |= {a + " tail", b + " tail"}
    c.write("nul.jsonl", _line(a + "\x00 tail") + b'{"text": "' + b.encode() + b'\x00 tail"}\n')
    c.expect("stripped_nul_bytes", 2)
    # a lone surrogate escape (orjson rejects it): U+FFFD, counted; a valid pair stays the character it encodes
    lone, pair = g("lone surrogate"), g("surrogate pair")
    c.texts -= {lone, pair}
    c.texts |= {lone + " \ufffd end", pair + " \U0001f600 end"}
    c.write(
        "surrogates.jsonl",
        b'{"text": "'
        + lone.encode()
        + b' \\ud800 end"}\n'
        + b'{"text": "'
        + pair.encode()
        + b' \\ud83d\\ude00 end"}\n',
    )
    c.expect("replaced_lone_surrogates")
    c.write("latin1.jsonl", _line(g("utf8")) + '{"text": "caf\u00e9 latin-1"}\n'.encode("latin-1"))
    c.expect("skipped_invalid_utf8")
    wrong = [
        b"[1, 2]",
        b"42",
        b'"a bare string"',
        b'{"text": null}',
        b'{"text": 7}',
        b'{"text": ["a", "b"]}',
        b'{"body": "no text field"}',
        b'{"text": "cut off',
        b"[" * 5000 + b"]" * 5000,
    ]
    c.write("types.jsonl", _line(g("types")) + b"\n".join(wrong) + b"\n\n")
    c.expect("skipped_not_an_object", 3)
    c.expect("skipped_null_text")
    c.expect("skipped_non_string_text", 2)
    c.expect("skipped_missing_text")
    c.expect("skipped_malformed_json", 2)  # cut off, and nested deeper than any parser goes
    rng = np.random.default_rng(0)
    huge = "huge record: " + " ".join(rng.choice(WORDS, 900_000))  # ~5.5 MB on one line
    c.texts.add(huge)
    c.write("huge.jsonl", _line(huge))
    c.write("empty.jsonl", b"")
    c.write("empty.jsonl.gz", b"")
    c.write("nothing.jsonl.gz", gzip.compress(b""))
    c.write("nothing.jsonl.zst", _zst(b""))
    # damaged: a complete first member/frame, then one record cut in half (gzip, zstd) or garbage
    before = b"".join(_line(g("before damage")) for _ in range(3))
    c.damaged("truncated.jsonl.gz", gzip.compress(before) + _cut_off(gzip.compress))
    ahead = b"".join(_line(g("ahead of garbage")) for _ in range(2))
    c.damaged("corrupt.jsonl.gz", gzip.compress(ahead) + b"not gzip at all")
    after = b"".join(_line(g("zstd before damage")) for _ in range(3))
    c.damaged("truncated.jsonl.zst", _zst(after) + _cut_off(_zst))
    # files no reader reads (records that must not appear) and a hidden file, which is not even listed
    for name in ("notes.md", "table.csv", "old.jsonl.bak"):
        c.write(name, _line("an ignored record " * 5))
        c.problem_files.append(name)
    c.expect("skipped_unknown_extension_file", 3)
    c.write(".DS_Store", b"\x00\x01")
    # unreadable: a dangling link, and (not as root, who reads anything) a file without permissions
    os.symlink(c.root / "nowhere.jsonl", c.root / "gone.jsonl")
    c.problem_files.append("gone.jsonl")
    c.expect("skipped_unreadable_file")
    if os.geteuid() != 0:
        c.write("locked.jsonl", _line("a locked record " * 5)).chmod(0)
        c.problem_files.append("locked.jsonl")
        c.expect("skipped_unreadable_file")


def _parquet_folder(c: Corpus) -> None:
    a, b = c.good("parquet"), c.good("parquet")
    c.write("a.parquet", _parquet(pa.table({"text": [a, None, b]})))
    c.expect("skipped_null_text")
    c.write("b.parquet", _parquet(pa.table({"text": pa.array([1, 2], pa.int64())})))
    c.expect("skipped_non_string_text", 2)
    c.write("c.parquet", _parquet(pa.table({"body": ["no text column"]})))
    c.expect("skipped_missing_text")
    whole = _parquet(pa.table({"text": ["a parquet record that is cut off " * 3]}))
    c.damaged("d.parquet", whole[: len(whole) // 2])


def _text_folder(c: Corpus) -> None:
    bom_crlf = c.good("text")
    c.texts -= {bom_crlf}
    c.texts.add(f"{bom_crlf}\nsecond line\n")
    c.write("bom_crlf.txt", b"\xef\xbb\xbf" + f"{bom_crlf}\r\nsecond line\r\n".encode())
    nul = c.good("text nul")
    c.write("nul.txt", nul[:10].encode() + b"\x00" + nul[10:].encode())
    c.expect("stripped_nul_bytes")
    c.write("empty.txt", b"")
    c.expect("dropped_empty")
    c.write("latin1.txt", "caf\u00e9 in latin-1".encode("latin-1"))
    c.expect("skipped_invalid_utf8")
    c.write("readme.md", b"# not data")
    c.problem_files.append("readme.md")
    c.expect("skipped_unknown_extension_file")


def _merge(*corpora: Corpus) -> tuple[set[str], dict[str, int]]:
    texts, skipped = set(), {}
    for c in corpora:
        texts |= c.texts
        for k, v in c.skipped.items():
            skipped[k] = skipped.get(k, 0) + v
    return texts, skipped


def _kept_texts(manifest: DataManifest) -> list[str]:
    """Every document in the written shards, decoded (the tokenizer is byte-level: decoding is exact)."""
    tok = Tokenizer.from_file(str(Path(manifest.tokenizer.path) / "tokenizer.json"))
    texts = []
    for s in manifest.splits.values():
        for prefix in s.prefixes:
            ds = IndexedDataset(prefix)
            texts += [tok.decode(np.asarray(ds[i])[:-1].tolist()) for i in range(len(ds))]
    return texts


def _cfg(workdir: Path, tiny_manifest: DataManifest, *overrides: str):
    """The demo tokenizer (no BPE training per test), no length or count limits."""
    return tiny_config(
        workdir,
        f"tokenizer.path={tiny_manifest.tokenizer.path}",
        "data.min_chars=0",
        "data.max_documents=null",
        "data.valid_fraction=0.25",
        *overrides,
    )


def test_every_readable_record_is_kept_and_every_other_counted(tmp_path, tiny_manifest, capsys):
    corpora = {name: Corpus(tmp_path / "src" / name) for name in ("jl", "tab", "txt")}
    _jsonl_folder(corpora["jl"])
    _parquet_folder(corpora["tab"])
    _text_folder(corpora["txt"])
    expected_texts, expected_skipped = _merge(*corpora.values())
    sources = "data.sources=[" + ", ".join(str(c.root) for c in corpora.values()) + "]"
    # three tasks, each reading every file: the counts must not triple
    m = prepare_data(_cfg(tmp_path, tiny_manifest, sources, "data.tasks=3"))
    out, err = capsys.readouterr()

    kept = _kept_texts(m)
    assert len(kept) == len(set(kept))
    assert set(kept) == expected_texts
    assert sum(s.documents for s in m.splits.values()) == len(expected_texts)
    assert m.skipped == expected_skipped
    assert not any("\r" in t for t in kept) and not any("\x00" in t for t in kept)

    assert "Traceback" not in out + err
    warnings = [line for line in err.splitlines() if line.startswith("warning: data prep: ")]
    problem_files = [f for c in corpora.values() for f in c.problem_files]
    assert len(warnings) == len(problem_files)
    for name in problem_files:  # each named in exactly one warning line
        assert sum(f"/{name} " in w for w in warnings) == 1, name
    (gz_warning,) = [w for w in warnings if "/truncated.jsonl.gz " in w]
    assert "is damaged (EOFError: Compressed file ended" in gz_warning
    assert "kept the 3 records before the damage" in gz_warning
    problems = {Path(p["file"]).name: p for p in m.file_problems}
    assert set(problems) == {Path(f).name for f in problem_files}
    assert problems["truncated.jsonl.zst"]["records_read"] == 3
    assert problems["gone.jsonl"]["problem"] == "unreadable"
    assert problems["d.parquet"]["problem"] == "damaged"

    (summary,) = [line for line in out.splitlines() if line.startswith("data prep: ")]
    removed = sum(
        v for k, v in expected_skipped.items() if k.startswith(("skipped_", "dropped_")) and not k.endswith("_file")
    )
    assert f"data prep: {len(expected_texts)} documents kept" in summary
    assert f"; {removed} records skipped or dropped (" in summary
    assert "files skipped (" in summary and "texts changed (" in summary


def test_truncated_zst_keeps_every_record_before_the_damage(tmp_path):
    """pyarrow's zstd stream drops what it decoded in a read that hits the damage; the reader recovers it."""
    lines = [_line(f"record {i} " + "x" * (i % 97)) for i in range(3000)]  # several 64 KiB reads
    (tmp_path / "big.jsonl.zst").write_bytes(_zst(b"".join(lines)) + _cut_off(_zst))
    reader = make_reader(tmp_path / "big.jsonl.zst", "jsonl", "text", "big")
    docs = list(reader.run())
    assert [d.text for d in docs] == [json.loads(x)["text"] for x in lines]
    assert reader.stats["skipped_damaged_file"].total == 1  # counted, not raised


@pytest.mark.parametrize("name", ["truncated.jsonl.gz", "gone.jsonl"])
def test_strict_fails_on_a_damaged_file_with_one_line(tmp_path, tiny_manifest, capsys, name):
    src = tmp_path / "src"
    src.mkdir()
    (src / "good.jsonl").write_bytes(b"".join(_line(f"good record {i} " * 5) for i in range(16)))
    if name == "gone.jsonl":
        os.symlink(src / "nowhere.jsonl", src / name)
    else:
        (src / name).write_bytes(gzip.compress(_line("first " * 20)) + _cut_off(gzip.compress))
    cfg = _cfg(tmp_path, tiny_manifest, f"data.sources=[{src}]", "data.strict=true")
    with pytest.raises(DataPrepError) as info:
        prepare_data(cfg)
    message = str(info.value)
    assert "\n" not in message and str(src / name) in message and "set data.strict=false" in message
    assert message.startswith("data.strict: ")
    assert "Traceback" not in "".join(capsys.readouterr())
    assert not (data_dir(cfg) / "logs").exists()  # failed before any work
    cfg = _cfg(tmp_path, tiny_manifest, f"data.sources=[{src}]")  # the default keeps the readable records
    assert prepare_data(cfg).skipped == {f"skipped_{'unreadable' if 'gone' in name else 'damaged'}_file": 1}


def _cli_prep(workdir: Path, *overrides: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [sys.executable, "-m", "difflm.flows.cli", "prep", "--preset", "test-tiny", f"workdir={workdir}", *overrides],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def test_cli_strict_error_is_one_line_without_traceback(tmp_path, tiny_manifest):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl.gz").write_bytes(_cut_off(gzip.compress))
    proc = _cli_prep(
        tmp_path / "w",
        f"data.sources=[{src}]",
        "data.strict=true",
        f"tokenizer.path={tiny_manifest.tokenizer.path}",
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"difflm: data.strict: {src / 'a.jsonl.gz'} is damaged (EOFError: Compressed file ended before the "
        f"end-of-stream marker was reached): repair or remove it, or set data.strict=false to keep the records "
        f"before the damage"
    )


def _shard_digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.suffix in (".bin", ".idx")
    }


@pytest.mark.integration  # data prep in CLI subprocesses
def test_prep_killed_with_sigkill_resumes_byte_identically(tmp_path):
    overrides = ("data.tasks=4", "data.workers=1")
    proc = _cli_prep(tmp_path / "killed", *overrides, start_new_session=True)
    marker = tmp_path / "killed" / "data"
    deadline = time.time() + 120
    try:  # kill once the first task is complete: the others are running or pending
        while not list(marker.glob("*/logs/completions/00000")):
            assert proc.poll() is None, f"prep ended before it could be killed: {proc.communicate()}"
            assert time.time() < deadline, "prep did not finish a task in 120 s"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the executor's manager process goes too
        proc.communicate()
    (killed,) = marker.glob("[!.]*")  # not the lock file beside it
    assert not (killed / "manifest.json").exists()
    assert len(list((killed / "logs" / "completions").iterdir())) < 4

    resumed = prepare_data(tiny_config(tmp_path / "killed", *overrides))
    reference = prepare_data(tiny_config(tmp_path / "reference", *overrides))
    assert Path(resumed.dir).name == Path(reference.dir).name
    digests = _shard_digests(Path(resumed.dir))
    assert len(digests) >= 4 and digests == _shard_digests(Path(reference.dir))
    assert resumed.splits["train"].documents == reference.splits["train"].documents > 0


_WRITE_BOMB = """
import sys
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
n = 512 << 20  # one document of 512 MiB (zero pages: nothing to fill), lz4: about 2 MB on disk
text = pa.LargeStringArray.from_buffers(1, pa.py_buffer(np.array([0, n], np.int64)), pa.py_buffer(np.zeros(n, np.uint8)))
pq.write_table(pa.table({"text": text}), sys.argv[1], compression="lz4", use_dictionary=False, write_statistics=False)
"""
_READ_BOMB = """
import json, re, sys
from pathlib import Path
from difflm.data_prep.readers import make_reader
reader = make_reader(Path(sys.argv[1]), "parquet", "text", "bomb")
docs = sum(1 for _ in reader.run())
# this process's own peak: getrusage's ru_maxrss keeps the launching process's peak across exec (pytest's)
peak_mb = int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024
print(json.dumps({"docs": docs, "skipped": reader.stats["skipped_oversize_record"].total, "peak_mb": peak_mb}))
"""


@pytest.mark.integration  # two processes: the writer's memory must not count, the reader's peak is measured
def test_a_parquet_file_holding_one_huge_document_is_skipped_in_bounded_memory(tmp_path):
    bomb = tmp_path / "bomb.parquet"
    subprocess.run([sys.executable, "-c", _WRITE_BOMB, str(bomb)], check=True)
    assert bomb.stat().st_size < 4 << 20
    out = subprocess.run(
        [sys.executable, "-c", _READ_BOMB, str(bomb)], cwd=ROOT, capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["docs"] == 0 and result["skipped"] == 1, result
    assert result["peak_mb"] < 400, result
    assert "bomb.parquet row 0: oversize record" in out.stderr


def test_an_empty_input_file_is_named_once_and_leaves_nothing(tmp_path, tiny_manifest):
    """An empty JSONL said "the train split is empty ... change data.valid_fraction" five times and left a half-made
    data folder: one line naming the file, nothing written."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    workdir = tmp_path / "w"
    proc = _cli_prep(workdir, f"data.sources=[{empty}]", f"tokenizer.path={tiny_manifest.tokenizer.path}")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert [ln for ln in err.splitlines() if ln.startswith("difflm:") or "split is empty" in ln] == [
        f"difflm: {empty} has no readable records (source 'empty'): give it documents, or remove it from data.sources"
    ], err[-3000:]
    assert not (workdir / "data").exists()
