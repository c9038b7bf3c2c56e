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
- a record over `MAX_RECORD_BYTES` (a JSONL line, a .txt file, a Parquet/Arrow text value, judged from the
  Parquet metadata before the row group is read) is a counted skip (`skipped_oversize_record`);
- texts are repaired, not dropped: a byte-order mark and Windows line endings of .txt files go, lone
  surrogate escapes in JSON become U+FFFD (`replaced_lone_surrogates`), NUL characters are removed
  (`stripped_nul_bytes`); both counts are of records.

Each task records the input bytes it read as the stat `read_bytes`.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import re
import zlib
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.readers.base import BaseDiskReader
from datatrove.pipeline.readers.ipc import IpcReader
from datatrove.utils.logging import logger
from tqdm import tqdm

from difflm.data_prep.sharding import InputFile, Piece, plan
from difflm.data_prep.zstd import ZstdRaw
from difflm.errors import UserError

FORMATS = ("jsonl", "parquet", "text", "hf_disk")
_COMPRESSED = ("", ".gz", ".zst", ".bz2", ".xz")
_SUFFIXES = {
    "jsonl": tuple(f"*.{ext}{c}" for ext in ("jsonl", "json") for c in _COMPRESSED),
    "parquet": ("*.parquet",),
    "text": ("*.txt",),
    "hf_disk": ("*.arrow",),
}
_MAX_LOGGED = 20
_BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")
# raw control characters (NUL, tab) inside strings are invalid JSON but readable: the stdlib parses them
_LENIENT_JSON = json.JSONDecoder(strict=False)
# a file that cannot be read to its end: I/O errors, truncated or corrupt streams (gzip and bz2 raise
# EOFError/OSError, deflate zlib.error, xz LZMAError, zstd via pyarrow OSError, Parquet/Arrow ArrowException)
_FILE_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError, pa.ArrowException)
_CANNOT_OPEN = (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)
_KINDS = {
    bool: "a boolean",
    int: "a number",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "an object",
    bytes: "binary data",
    type(None): "null",
}


class DamagedFileError(UserError, ValueError):
    """A damaged or unreadable input file under `strict`; the message is one line that says what to do."""


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


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch(name, p) for p in patterns)


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


def _one_line(err: BaseException) -> str:
    """An exception as `Type: message` on one line (pyarrow messages can span several)."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _kind(value) -> str:
    return _KINDS.get(type(value), f"a {type(value).__name__}")


def _text_problem(record: dict, key: str) -> tuple[str, str] | None:
    """(reason, detail) when a record has no usable text field, else None."""
    if key not in record:
        return "missing_text", f"(no field {key!r}; fields: {sorted(record)[:8]}; set the source's text_key)"
    value = record[key]
    if value is None:
        return "null_text", f"(field {key!r} is null)"
    if not isinstance(value, str):
        return "non_string_text", f"(field {key!r} is {_kind(value)}, not a string)"
    return None


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


class _TolerantMixin:
    """Read this task's share of the input (or, with `by_input` off, every file in every task, counting in the
    first task only), and keep the records of a file read before it breaks off."""

    quiet = False  # set for extra passes over the input (tokenizer training): skips are logged once
    strict = False  # a damaged or unreadable file raises DamagedFileError
    report_dir: str | None = None  # where damaged/unreadable files are reported (one JSON file each)
    patterns: tuple[str, ...] = ()  # read only files named so (folder sources); others are listed apart
    by_input = True  # False: every task reads every record (a HashShard step partitions the documents)
    _counting = True

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        self._logged = 0
        if not self.by_input:
            self._counting = rank == 0  # every task reads every record: one count, not one per task
            yield from super().run(data, 0, 1)  # type: ignore[misc]
            return
        self._counting = True
        if data:
            yield from data
        pieces = plan(self._input_files(), rank, world_size)
        with tqdm(desc="Document progress", unit="doc", disable=not self.doc_progress) as bar:  # type: ignore[attr-defined]
            for piece in pieces:
                part = "" if piece.whole else f" bytes {piece.start}-{piece.end}"
                logger.info(f"Reading input file {piece.path}{part}")  # the task's log only (difflm.data_prep.quiet)
                n = 0
                for doc in self.read_file(piece.path, piece):
                    n += 1
                    yield doc
                bar.update(n)
                self.stat_update("documents", value=n, unit="input_file")  # type: ignore[attr-defined]

    def _input_files(self) -> list[InputFile]:
        folder = self.data_folder  # type: ignore[attr-defined]
        files = folder.list_files(recursive=self.recursive, glob_pattern=self.glob_pattern)  # type: ignore[attr-defined]
        if self.patterns:
            files = [f for f in files if _matches(Path(f).name, self.patterns)]
        return [InputFile(f, _size(folder, f), self._splittable(f)) for f in files]

    def _splittable(self, filepath: str) -> bool:
        return False

    def read_files_shard(self, shard: list[str]) -> DocumentsPipeline:
        if self.patterns:
            shard = [f for f in shard if _matches(Path(f).name, self.patterns)]
        return super().read_files_shard(shard)  # type: ignore[misc]

    def read_file(self, filepath: str, piece: Piece | None = None) -> DocumentsPipeline:
        """The documents of one file (or of its `piece`). Caught here, not left to datatrove, a file that breaks
        off keeps the documents read before the damage instead of aborting the whole prep."""
        read = 0
        piece = piece or Piece(filepath)
        try:
            for doc in self._records(piece):
                read += 1
                yield doc
        except _FILE_ERRORS as err:
            self._file_fault(filepath, err, read)
        if piece.whole:
            self.stat_update("read_bytes", value=_size(self.data_folder, filepath))  # type: ignore[attr-defined]

    def _records(self, piece: Piece) -> DocumentsPipeline:
        """The documents of one file (or of a byte range of it, for the readers that can cut files), format by
        format: every reader of this module defines it; `read_file` wraps it with the damaged-file handling."""
        raise NotImplementedError(f"{type(self).__name__} must define _records(piece)")

    def _file_fault(self, filepath: str, err: BaseException, read: int) -> None:
        path = self.data_folder.resolve_paths(filepath)  # type: ignore[attr-defined]
        problem = "unreadable" if isinstance(err, _CANNOT_OPEN) else "damaged"
        if self.strict:
            raise DamagedFileError(strict_message(path, problem, _one_line(err)))
        if not self._counting:
            return
        self.stat_update(f"skipped_{problem}_file")  # type: ignore[attr-defined]
        if self.report_dir:
            save_fault(
                self.report_dir, {"file": path, "problem": problem, "error": _one_line(err), "records_read": read}
            )

    def _count(self, key: str) -> None:
        if self._counting:
            self.stat_update(key)  # type: ignore[attr-defined]

    def _skip(self, reason: str, where: str, detail: str = "", n: int = 1) -> None:
        """`n` records skipped for `reason` (counted, the first ones logged); `where` names the first."""
        if not n:
            return
        if self._counting:
            self.stat_update(f"skipped_{reason}", value=n)  # type: ignore[attr-defined]
        if self._counting and not self.quiet and self._logged < _MAX_LOGGED:
            self._logged += 1
            logger.warning(f"skipping record at {where}: {reason.replace('_', ' ')} {detail}".rstrip())

    def _usable_text(self, record: dict, where: str) -> str | None:
        problem = _text_problem(record, self.text_key)  # type: ignore[attr-defined]
        if problem:
            self._skip(problem[0], where, problem[1])
            return None
        return record[self.text_key]  # type: ignore[attr-defined]

    def _repaired(self, text: str, lenient_json: bool = False) -> str:
        """The text with lone surrogates (only the stdlib JSON parser lets them through) replaced by U+FFFD
        and NUL characters removed (never meant as text; they break C-string tools): counted records."""
        if lenient_json:
            text, n = _SURROGATE.subn("\ufffd", text)
            if n:
                self._count("replaced_lone_surrogates")
        if "\x00" in text:
            text = text.replace("\x00", "")
            self._count("stripped_nul_bytes")
        return text


def strict_message(path: str, problem: str, error: str) -> str:
    if problem == "unreadable":
        return f"{path} cannot be read ({error}): fix or remove it, or set data.strict=false to skip it"
    return (
        f"{path} is damaged ({error}): repair or remove it, or set data.strict=false to keep the records "
        f"before the damage"
    )


def save_fault(report_dir: str, fault: dict) -> None:
    """One JSON file per faulty input file, written atomically (tasks can be killed at any point)."""
    os.makedirs(report_dir, exist_ok=True)
    name = hashlib.blake2b(fault["file"].encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()
    tmp = os.path.join(report_dir, f"{name}.part")
    with open(tmp, "w") as f:
        json.dump(fault, f)
    os.replace(tmp, os.path.join(report_dir, f"{name}.json"))


def load_faults(report_dir: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in report_dir.glob("*.json")), key=lambda f: f["file"])


# One record (a JSONL line, a .txt file) is read into memory at most this long: a longer one is a counted skip
# (`skipped_oversize_record`, logged with file and line), read past in 1 MiB pieces. A small compressed file
# can hold a huge line (256 MiB of one line gzip to 255 KB); without a bound, reading it took 1.45 GB per task.
MAX_RECORD_BYTES = 32 << 20
# One JSONL file is read up to this many (decompressed) bytes: past it, the rest of the file is a counted skip
# (`skipped_oversize_file`, logged with the file). A plain file over it is not opened at all; a compressed one
# (whose size is only known by reading it: a few KB of gzip can hold terabytes) keeps the records before the
# cap, as a damaged file does. Memory stays flat either way (one record at a time).
MAX_FILE_BYTES = 64 << 30
_COMPRESSED = (".gz", ".zst", ".bz2", ".xz")


class _OversizeFile(Exception):
    """The file went past its reader's `max_file_bytes`."""


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


def _size(folder, filepath: str) -> int:
    """A file's size, 0 when it cannot be read (a dangling link): reading it then reports it."""
    try:
        return folder.size(filepath)
    except OSError:
        return 0


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

    def _skip_file(self, filepath: str, detail: str) -> None:
        """The (rest of the) file is over `max_file_bytes`: one counted skip, logged with the file."""
        self._count("skipped_oversize_file")
        if self._counting and not self.quiet:
            logger.warning(f"skipping file {filepath}: oversize file {detail}")

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


# A Parquet row group's text column is read only after its decompressed size, from the file's metadata, is known:
# a 16 KiB file can hold one 512 MiB document (2.15 GB of memory to read it unbounded). One row over this is a
# counted `skipped_oversize_record`, never read; a larger group of many rows is read a few MiB of rows at a time
# (Parquet records no per-value sizes, so one huge value among many rows is still read before it is skipped).
MAX_ROW_GROUP_TEXT_BYTES = 256 << 20
_PARQUET_BATCH_BYTES = 8 << 20


class ParquetSource(_TolerantMixin, BaseDiskReader):
    """Parquet files, the text column read in bounded batches, row group by row group."""

    name = "📒 Parquet (bounded)"

    def __init__(self, data_folder, glob_pattern: str | None = None, text_key: str = "text", source="", **kwargs):
        super().__init__(data_folder, glob_pattern=glob_pattern, text_key=text_key, **kwargs)
        self.source = source

    def _records(self, piece: Piece) -> DocumentsPipeline:
        filepath, row = piece.path, 0
        with self.data_folder.open(filepath, "rb") as f, pq.ParquetFile(f, buffer_size=1 << 20) as pqf:
            meta = pqf.metadata
            if self.text_key not in pqf.schema_arrow.names:
                fields = sorted(pqf.schema_arrow.names)[:8]
                detail = f"(no field {self.text_key!r}; fields: {fields}; set the source's text_key)"
                self._skip("missing_text", f"{filepath} row 0", detail, n=meta.num_rows)
                return
            column = pqf.schema_arrow.names.index(self.text_key)
            for group in range(meta.num_row_groups):
                rows = meta.row_group(group).num_rows
                size = _text_column_bytes(meta.row_group(group), self.text_key, column)
                if rows == 1 and size > MAX_ROW_GROUP_TEXT_BYTES:
                    self._skip("oversize_record", f"{filepath} row {row}", f"({size} bytes of text, over the limit)")
                    row += rows
                    continue
                batch_rows = max(1, _PARQUET_BATCH_BYTES * rows // max(size, 1))
                for batch in pqf.iter_batches(batch_size=batch_rows, row_groups=[group], columns=[self.text_key]):
                    yield from self._batch_documents(batch.column(0), filepath, row)
                    row += batch.num_rows

    def _batch_documents(self, values: pa.Array, filepath: str, row: int) -> DocumentsPipeline:
        is_text = pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
        sizes = pc.binary_length(values).to_pylist() if is_text else [0] * len(values)
        for i, (value, size) in enumerate(zip(values.to_pylist(), sizes)):
            where = f"{filepath} row {row + i}"
            if size and size > MAX_RECORD_BYTES:
                self._skip("oversize_record", where, f"(a text over {MAX_RECORD_BYTES >> 20} MiB)")
                continue
            text = self._usable_text({self.text_key: value}, where)
            if text is not None:
                yield Document(text=self._repaired(text), id=f"{self.source}:{where}", metadata={"source": self.source})


def _text_column_bytes(group, name: str, column: int) -> int:
    """The decompressed bytes of column `name` in one row group's metadata (its leaf columns together)."""
    paths = [group.column(j).path_in_schema for j in range(group.num_columns)]
    leaves = [j for j, p in enumerate(paths) if p == name or p.startswith(f"{name}.")] or [column]
    return sum(group.column(j).total_uncompressed_size for j in leaves)


def _tabular(reader_cls, source: str, text_key: str):
    """A datatrove tabular reader (Arrow IPC) that tolerates bad records and tags the source."""

    class Tabular(_TolerantMixin, reader_cls):
        def _records(self, piece: Piece) -> DocumentsPipeline:
            self._row = 0  # datatrove's id_in_file counts kept rows only; messages name the real row
            return reader_cls.read_file(self, piece.path)

        def get_document_from_dict(self, data: dict, source_file: str, id_in_file):
            where, self._row = f"{source_file} row {self._row}", self._row + 1
            text = self._usable_text(data, where)
            if text is None:
                return None
            return Document(
                text=self._repaired(text), id=f"{source}:{source_file}:{id_in_file}", metadata={"source": source}
            )

    Tabular.__name__ = f"{reader_cls.__name__}Source"
    return Tabular


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
        reader = _tabular(IpcReader, source, text_key)(
            str(folder), glob_pattern=glob or "**/*.arrow", stream=True, text_key=text_key, doc_progress=progress
        )
    else:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    if glob is None:  # a folder: its files of other formats are listed by unknown_files, not read
        reader.patterns = _SUFFIXES[fmt]
    return reader
