"""What every reader of data_prep shares: a task's share of the input, damaged and unreadable files kept up to the
damage and reported, bad records skipped and counted (`skipped_<reason>`), texts repaired, and the limits on
what one record and one file may hold (`MAX_RECORD_BYTES`, `MAX_FILE_BYTES`)."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import zlib
from fnmatch import fnmatch
from pathlib import Path

import pyarrow as pa
from datatrove.data import DocumentsPipeline
from datatrove.utils.logging import logger
from tqdm import tqdm

from difflm.data_prep.sharding import InputFile, Piece, plan
from difflm.errors import UserError

_MAX_LOGGED = 20
_SURROGATE = re.compile("[\ud800-\udfff]")
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


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch(name, p) for p in patterns)


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

    def _skip_file(self, filepath: str, detail: str) -> None:
        """The (rest of the) file is over `max_file_bytes`: one counted skip, logged with the file."""
        self._count("skipped_oversize_file")
        if self._counting and not self.quiet:
            logger.warning(f"skipping file {filepath}: oversize file {detail}")

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


# One record (a JSONL line, a .txt file, a Parquet or Arrow text) is read into memory at most this long: a longer
# one is a counted skip (`skipped_oversize_record`, logged with file and line or row). A small compressed file
# can hold a huge line (256 MiB of one line gzip to 255 KB); without a bound, reading it took 1.45 GB per task.
MAX_RECORD_BYTES = 32 << 20
# One file is read up to this many (decompressed, expanded) bytes: past it, the rest of the file is a counted skip
# (`skipped_oversize_file`, logged with the file). A plain JSONL file over it is not opened at all; a compressed
# one (whose size is only known by reading it: a few KB of gzip can hold terabytes), or a Parquet file whose
# dictionary values repeat, keeps the records before the cap, as a damaged file does. Memory stays flat either way.
MAX_FILE_BYTES = 64 << 30


class _OversizeFile(Exception):
    """The file went past its reader's `max_file_bytes`."""


def _size(folder, filepath: str) -> int:
    """A file's size, 0 when it cannot be read (a dangling link): reading it then reports it."""
    try:
        return folder.size(filepath)
    except OSError:
        return 0
