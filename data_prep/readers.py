"""datatrove readers for every input format, tolerant of bad records and damaged files.

Each task reads about 1/N of the input bytes (`difflm.data_prep.sharding`: files dealt across tasks, uncompressed
JSON lines cut at record boundaries into byte ranges), so reading costs O(corpus) whatever the number of
tasks; every record is read, and counted, by exactly one task. `data.dedup` and `data.max_documents` need
every document in view: with either, every task reads every record, a `HashShard` step keeps the documents
of one task by a hash of their text (exact duplicates meet in the same task), and only the first task counts.

Nothing readable is lost:
- bad records are skipped and counted in datatrove's stats (`skipped_<reason>`), the first ones logged
  with their file and line (or byte offset, in a range of a file);
- a file that breaks off (truncated or corrupt .gz/.zst/.bz2/.xz, I/O error) keeps the records before the
  damage and is counted (`skipped_damaged_file`) and reported; one that cannot be opened at all is
  `skipped_unreadable_file`. With `strict`, either raises `DamagedFileError` instead;
- a record over `MAX_RECORD_BYTES` (a JSONL line, a .txt file, a Parquet/Arrow text value, judged before it is
  copied: `difflm.data_prep.columnar`) is a counted skip (`skipped_oversize_record`), and a file is read up to
  `MAX_FILE_BYTES` of (decompressed, expanded) text (`skipped_oversize_file`);
- texts are repaired, not dropped: a byte-order mark and Windows line endings of .txt files go, lone
  surrogate escapes in JSON become U+FFFD (`replaced_lone_surrogates`), NUL characters are removed
  (`stripped_nul_bytes`); both counts are of records.

Each task records the input bytes it read as the stat `read_bytes`. What the readers share is in
`difflm.data_prep.tolerant`; the Parquet and Arrow readers are in `difflm.data_prep.columnar`.
"""

from __future__ import annotations

import io
import json
from contextlib import contextmanager
from pathlib import Path

import orjson
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.readers.base import BaseDiskReader

from difflm.data_prep.columnar import ArrowSource, ParquetSource
from difflm.data_prep.sharding import Piece
from difflm.data_prep.tolerant import (
    MAX_FILE_BYTES,
    MAX_RECORD_BYTES,
    _kind,
    _matches,
    _OversizeFile,
    _TolerantMixin,
)
from difflm.data_prep.zstd import ZstdRaw

FORMATS = ("jsonl", "parquet", "text", "hf_disk")
_COMPRESSED = ("", ".gz", ".zst", ".bz2", ".xz")
_SUFFIXES = {
    "jsonl": tuple(f"*.{ext}{c}" for ext in ("jsonl", "json") for c in _COMPRESSED),
    "parquet": ("*.parquet",),
    "text": ("*.txt",),
    "hf_disk": ("*.arrow",),
}
_BOM = b"\xef\xbb\xbf"
# raw control characters (NUL, tab) inside strings are invalid JSON but readable: the stdlib parses them
_LENIENT_JSON = json.JSONDecoder(strict=False)


def detect_format(path: Path) -> str:
    """The format of a file or folder, from names (a folder with state.json is a saved HF dataset)."""
    if path.is_dir():
        if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
            return "hf_disk"
        for fmt in ("jsonl", "parquet", "text"):
            if any(next(path.rglob(p), None) for p in _SUFFIXES[fmt]):
                return fmt
        raise ValueError(f"{path}: no .jsonl[.gz], .parquet, .txt files or saved HF dataset inside")
    name = path.name
    for fmt, pats in _SUFFIXES.items():
        if _matches(name, pats):
            return fmt
    raise ValueError(f"{path}: unknown format (expected .jsonl[.gz|.zst], .parquet, .txt or an HF dataset folder)")


def unknown_files(path: Path, fmt: str) -> list[Path]:
    """Files of a source folder that its reader does not read (another format, an unknown extension).
    Hidden files and the metadata of a saved HF dataset are not data, so they are not listed."""
    if not path.is_dir() or fmt == "hf_disk":
        return []
    return sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and not _matches(p.name, _SUFFIXES[fmt])
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )


def _loads(line: str):
    """(value, lenient) of one JSON line: orjson, else the stdlib's lenient parser for what orjson rejects
    but is readable: lone surrogate escapes ("\\ud800") and raw control characters inside strings."""
    try:
        return orjson.loads(line), False
    except orjson.JSONDecodeError as err:
        try:
            return _LENIENT_JSON.decode(line), True
        except (ValueError, RecursionError):  # the stdlib recurses where orjson stops at depth 1024
            raise err from None


_COMPRESSED = (".gz", ".zst", ".bz2", ".xz")


class _CappedReader:
    """`readline` of binary file `f` that raises _OversizeFile once more than `limit` bytes were read from it."""

    def __init__(self, f, limit: int):
        self._f, self._limit, self.read = f, limit, 0

    def readline(self, size: int = -1) -> bytes:
        line = self._f.readline(size)
        self.read += len(line)
        if self.read > self._limit:
            raise _OversizeFile(self.read)
        return line


def _past_line(f) -> int:
    """Read binary file `f` past the end of the current line (1 MiB at a time); the bytes read."""
    n = 0
    while True:
        rest = f.readline(1 << 20)
        n += len(rest)
        if not rest or rest.endswith(b"\n"):
            return n


def _bounded_lines(f, limit: int):
    """The lines of binary file `f`, each read with at most `limit` bytes in memory: a longer line is yielded
    as None once its rest has been read past."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            _past_line(f)  # skip to the end of this line without keeping it
            yield None
        else:
            yield line


class JsonlSource(_TolerantMixin, BaseDiskReader):
    """JSON lines (optionally .gz/.zst/.bz2/.xz): invalid UTF-8, malformed JSON, non-objects and records
    without a string text field are counted skips."""

    name = "🐿 Jsonl (tolerant)"
    max_file_bytes = MAX_FILE_BYTES  # per instance in tests

    def __init__(
        self, data_folder, glob_pattern: str | None = None, text_key: str = "text", source: str = "", **kwargs
    ):
        super().__init__(data_folder, glob_pattern=glob_pattern, text_key=text_key, **kwargs)
        self.source = source

    @contextmanager
    def _open(self, filepath: str):
        if filepath.endswith(".zst"):
            with io.BufferedReader(ZstdRaw(lambda: self.data_folder.open(filepath, "rb")), 1 << 16) as f:
                yield f
        else:  # fsspec decompresses .gz, .bz2 and .xz by the extension
            with self.data_folder.open(filepath, "rb", compression="infer") as f:
                yield f

    def _splittable(self, filepath: str) -> bool:
        return not filepath.endswith(_COMPRESSED)

    def _records(self, piece: Piece) -> DocumentsPipeline:
        filepath, cap = piece.path, self.max_file_bytes
        if not filepath.endswith(_COMPRESSED) and (size := self.data_folder.size(filepath)) > cap:
            if piece.start == 0:  # one count, by the task whose piece opens the file
                self._skip_file(filepath, f"({size} bytes, over {cap}: not read)")
            return
        if not piece.whole:
            yield from self._range(piece)
            return
        li = 0
        try:
            with self._open(filepath) as f:
                for li, raw in enumerate(_bounded_lines(_CappedReader(f, cap), MAX_RECORD_BYTES), start=1):
                    if raw is None:
                        self._skip("oversize_record", f"{filepath}:{li}", f"(a line over {MAX_RECORD_BYTES >> 20} MiB)")
                        continue
                    text = self._text_of_line(raw, f"{filepath}:{li}")
                    if text is not None:
                        yield Document(text=text, id=f"{self.source}:{filepath}:{li}", metadata={"source": self.source})
        except _OversizeFile:
            self._skip_file(filepath, f"(decompressed past {cap} bytes at line {li + 1}: the lines before are kept)")

    def _range(self, piece: Piece) -> DocumentsPipeline:
        """The records of an uncompressed file that start in bytes [piece.start, piece.end): the line that holds
        byte start - 1 belongs to the range before, and the last record is read to its end."""
        assert piece.end is not None
        filepath, pos = piece.path, piece.start
        with self.data_folder.open(filepath, "rb") as f:
            if pos:
                f.seek(pos - 1)
                pos += _past_line(f) - 1
            first = max(piece.start - 1, 0)
            try:
                while pos < piece.end:
                    raw = f.readline(MAX_RECORD_BYTES + 1)
                    if not raw:
                        break
                    where = f"{filepath} byte {pos}"
                    pos += len(raw)
                    if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
                        pos += _past_line(f)
                        self._skip("oversize_record", where, f"(a line over {MAX_RECORD_BYTES >> 20} MiB)")
                        continue
                    text = self._text_of_line(raw, where)
                    if text is not None:
                        yield Document(text=text, id=f"{self.source}:{where}", metadata={"source": self.source})
            finally:
                self.stat_update("read_bytes", value=pos - first)

    def _text_of_line(self, raw: bytes, where: str) -> str | None:
        """The (repaired) text of one line, or None for a blank line or a counted skip."""
        if raw.startswith(_BOM):  # opens the file, or a file concatenated into this one
            raw = raw[len(_BOM) :]
        raw = raw.rstrip(b"\r\n")  # LF or CRLF; a cut-off record then reads as "unexpected end of data"
        if not raw.strip():
            return None
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            self._skip("invalid_utf8", where, f"({err.reason} at byte {err.start})")
            return None
        try:
            record, lenient = _loads(line)
        except ValueError as err:
            self._skip("malformed_json", where, f"({err})")
            return None
        if not isinstance(record, dict):
            self._skip("not_an_object", where, f"({_kind(record)}, not an object)")
            return None
        text = self._usable_text(record, where)
        return None if text is None else self._repaired(text, lenient)


class TextFolderSource(_TolerantMixin, BaseDiskReader):
    """A folder of .txt files, one document per file."""

    name = "📄 Text files"

    def __init__(self, data_folder, glob_pattern: str | None = None, source: str = "", **kwargs):
        super().__init__(data_folder, glob_pattern=glob_pattern, **kwargs)
        self.source = source

    def _records(self, piece: Piece) -> DocumentsPipeline:
        filepath = piece.path
        with self.data_folder.open(filepath, "rb") as f:
            raw = f.read(MAX_RECORD_BYTES + 1)
        if len(raw) > MAX_RECORD_BYTES:
            self._skip("oversize_record", filepath, f"(a file over {MAX_RECORD_BYTES >> 20} MiB)")
            return
        try:
            text = raw.decode("utf-8-sig")  # a byte-order mark is not text
        except UnicodeDecodeError as err:
            self._skip("invalid_utf8", filepath, f"({err.reason} at byte {err.start})")
            return
        text = text.replace("\r\n", "\n")  # Windows line endings: the same text as on any other system
        yield Document(text=self._repaired(text), id=f"{self.source}:{filepath}", metadata={"source": self.source})


def make_reader(path: Path, fmt: str, text_key: str, source: str, progress: bool = False):
    """The reader step for one source."""
    folder, glob = (path, None) if path.is_dir() else (path.parent, path.name)
    if fmt == "jsonl":
        reader = JsonlSource(
            str(folder), glob_pattern=glob or "**/*.json*", text_key=text_key, source=source, doc_progress=progress
        )
    elif fmt == "text":
        reader = TextFolderSource(str(folder), glob_pattern=glob or "**/*.txt", source=source, doc_progress=progress)
    elif fmt == "parquet":
        reader = ParquetSource(
            str(folder), glob_pattern=glob or "**/*.parquet", text_key=text_key, source=source, doc_progress=progress
        )
    elif fmt == "hf_disk":  # `datasets.save_to_disk` writes Arrow IPC streams
        reader = ArrowSource(
            str(folder), glob_pattern=glob or "**/*.arrow", text_key=text_key, source=source, doc_progress=progress
        )
    else:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    if glob is None:  # a folder: its files of other formats are listed by unknown_files, not read
        reader.patterns = _SUFFIXES[fmt]
    return reader
