"""datatrove readers for every input format, tolerant of bad records and damaged files.

Every reader yields all documents of its source (each task reads every file) and a `HashShard` step
keeps the documents of one task by a hash of their text. So the partition of documents over tasks
depends only on content (stable across reruns and file layouts), and exact duplicates always meet in
the same task, which makes per-task de-duplication global.

Nothing readable is lost:
- bad records are skipped and counted in datatrove's stats (`skipped_<reason>`), the first ones logged
  with their file and line; only the first task counts and logs, since every task reads every record;
- a file that breaks off (truncated or corrupt .gz/.zst/.bz2/.xz, I/O error) keeps the records before the
  damage and is counted (`skipped_damaged_file`) and reported; one that cannot be opened at all is
  `skipped_unreadable_file`. With `strict`, either raises `DamagedFileError` instead;
- texts are repaired, not dropped: a byte-order mark and Windows line endings of .txt files go, lone
  surrogate escapes in JSON become U+FFFD (`replaced_lone_surrogates`), NUL characters are removed
  (`stripped_nul_bytes`); both counts are of records.
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
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.readers import ParquetReader
from datatrove.pipeline.readers.base import BaseDiskReader
from datatrove.pipeline.readers.ipc import IpcReader
from datatrove.utils.logging import logger

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


class _ZstdRaw(io.RawIOBase):
    """The decompressed bytes of a .zst file, by pyarrow's zstd codec (pyarrow is a dependency; the
    `zstandard` package that fsspec would need is not).

    pyarrow drops what it decoded in a read that then hits damage. So after an error the file is read
    again up to where the last good read ended, then one byte at a time: every readable byte comes out
    before the error is raised.
    """

    def __init__(self, opener):
        self._opener = opener  # () -> binary file of the compressed bytes
        self._raw = opener()
        self._stream = self._decompressor(self._raw)
        self._pos = 0  # decompressed bytes delivered
        self._tail: bytes | None = None  # recovered after damage
        self._error: OSError | None = None

    @staticmethod
    def _decompressor(raw):
        return pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd")

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self._tail is None:
            try:
                data = self._stream.read(len(buf))
            except OSError as err:
                self._tail, self._error = self._readable_tail(), err
        if self._tail is not None:
            if not self._tail:
                raise self._error
            data, self._tail = self._tail[: len(buf)], self._tail[len(buf) :]
        buf[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def _readable_tail(self) -> bytes:
        """The bytes after those delivered that decode before the damage."""
        tail, done = bytearray(), 0
        with self._opener() as raw:
            stream = self._decompressor(raw)
            try:
                while done < self._pos:  # decoded before, so they decode again
                    chunk = stream.read(min(1 << 20, self._pos - done))
                    if not chunk:
                        break
                    done += len(chunk)
                while done == self._pos and (byte := stream.read(1)):
                    tail += byte
            except OSError:
                pass
        return bytes(tail) if done == self._pos else b""

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class _AllFilesMixin:
    """Read every file in every task (HashShard does the partition), count in the first task only, and
    keep the records of a file read before it breaks off."""

    quiet = False  # set for extra passes over the input (tokenizer training): skips are logged once
    strict = False  # a damaged or unreadable file raises DamagedFileError
    report_dir: str | None = None  # where damaged/unreadable files are reported (one JSON file each)
    patterns: tuple[str, ...] = ()  # read only files named so (folder sources); others are listed apart
    _counting = True

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        self._logged = 0
        self._counting = rank == 0  # every task reads every record: one count, not one per task
        yield from super().run(data, 0, 1)  # type: ignore[misc]

    def read_files_shard(self, shard: list[str]) -> DocumentsPipeline:
        if self.patterns:
            shard = [f for f in shard if _matches(Path(f).name, self.patterns)]
        return super().read_files_shard(shard)  # type: ignore[misc]

    def read_file(self, filepath: str) -> DocumentsPipeline:
        """The documents of one file. Caught here, not left to datatrove, a file that breaks off keeps the
        documents read before the damage instead of aborting the whole prep."""
        read = 0
        try:
            for doc in self._records(filepath):
                read += 1
                yield doc
        except _FILE_ERRORS as err:
            self._file_fault(filepath, err, read)

    def _records(self, filepath: str) -> DocumentsPipeline:
        """The documents of one file, format by format: every reader of this module defines it (JSONL, text
        files, the tabular readers); `read_file` wraps it with the damaged-file handling."""
        raise NotImplementedError(f"{type(self).__name__} must define _records(filepath)")

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

    def _skip(self, reason: str, where: str, detail: str = "") -> None:
        self._count(f"skipped_{reason}")
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


def _bounded_lines(f, limit: int):
    """The lines of binary file `f`, each read with at most `limit` bytes in memory: a longer line is yielded
    as None once its rest has been read past."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while True:  # skip to the end of this line without keeping it
                rest = f.readline(1 << 20)
                if not rest or rest.endswith(b"\n"):
                    break
            yield None
        else:
            yield line


class JsonlSource(_AllFilesMixin, BaseDiskReader):
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
            with io.BufferedReader(_ZstdRaw(lambda: self.data_folder.open(filepath, "rb")), 1 << 16) as f:
                yield f
        else:  # fsspec decompresses .gz, .bz2 and .xz by the extension
            with self.data_folder.open(filepath, "rb", compression="infer") as f:
                yield f

    def _records(self, filepath: str) -> DocumentsPipeline:
        cap = self.max_file_bytes
        if not filepath.endswith(_COMPRESSED) and self.data_folder.size(filepath) > cap:
            self._skip_file(filepath, f"({self.data_folder.size(filepath)} bytes, over {cap}: not read)")
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


class TextFolderSource(_AllFilesMixin, BaseDiskReader):
    """A folder of .txt files, one document per file."""

    name = "📄 Text files"

    def __init__(self, data_folder, glob_pattern: str | None = None, source: str = "", **kwargs):
        super().__init__(data_folder, glob_pattern=glob_pattern, **kwargs)
        self.source = source

    def _records(self, filepath: str) -> DocumentsPipeline:
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


def _tabular(reader_cls, source: str, text_key: str):
    """A datatrove tabular reader (Parquet, Arrow IPC) that reads all files and tags the source."""

    class Tabular(_AllFilesMixin, reader_cls):
        def _records(self, filepath: str) -> DocumentsPipeline:
            self._row = 0  # datatrove's id_in_file counts kept rows only; messages name the real row
            return reader_cls.read_file(self, filepath)

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
        reader = _tabular(ParquetReader, source, text_key)(
            str(folder), glob_pattern=glob or "**/*.parquet", text_key=text_key, doc_progress=progress
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
