"""datatrove readers for every input format, tolerant of bad records.

Every reader yields all documents of its source (each task reads every file) and a `HashShard` step
keeps the documents of one task by a hash of their text. So the partition of documents over tasks
depends only on content (stable across reruns and file layouts), and exact duplicates always meet in
the same task, which makes per-task de-duplication global.

Bad records are skipped and counted in datatrove's stats (`skipped_*`), the first ones logged with
their file and line.
"""

from __future__ import annotations

from pathlib import Path

from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.readers.base import BaseDiskReader
from datatrove.utils.logging import logger

FORMATS = ("jsonl", "parquet", "text", "hf_disk")
_SUFFIXES = {
    "jsonl": ("*.jsonl", "*.jsonl.gz", "*.jsonl.zst", "*.json", "*.json.gz"),
    "parquet": ("*.parquet",),
    "text": ("*.txt",),
    "hf_disk": ("*.arrow",),
}
_MAX_LOGGED = 20


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
        if any(Path(name).match(p) for p in pats):
            return fmt
    raise ValueError(f"{path}: unknown format (expected .jsonl[.gz|.zst], .parquet, .txt or an HF dataset folder)")


class _AllFilesMixin:
    """Read every file in every task; HashShard does the partition."""

    quiet = False  # set for extra passes over the input (tokenizer training): skips are logged once

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        self._logged = 0
        yield from super().run(data, 0, 1)  # type: ignore[misc]

    def _skip(self, reason: str, where: str, detail: str = "") -> None:
        self.stat_update(f"skipped_{reason}")
        if not self.quiet and self._logged < _MAX_LOGGED:
            self._logged += 1
            logger.warning(f"skipping record at {where}: {reason.replace('_', ' ')} {detail}".rstrip())


class JsonlSource(_AllFilesMixin, BaseDiskReader):
    """JSON lines (optionally .gz/.zst): malformed JSON, invalid UTF-8, non-objects and records without
    a string text field are counted skips."""

    name = "🐿 Jsonl (tolerant)"

    def __init__(self, data_folder, glob_pattern: str | None = None, text_key: str = "text", source: str = "",
                 **kwargs):
        super().__init__(data_folder, glob_pattern=glob_pattern, text_key=text_key, **kwargs)
        self.source = source

    def read_file(self, filepath: str):
        import orjson

        with self.data_folder.open(filepath, "rb", compression="infer") as f:
            for li, raw in enumerate(f, start=1):
                where = f"{filepath}:{li}"
                if not raw.strip():
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    self._skip("invalid_utf8", where, f"({err.reason} at byte {err.start})")
                    continue
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError as err:
                    self._skip("malformed_json", where, f"({err})")
                    continue
                if not isinstance(record, dict):
                    self._skip("not_an_object", where)
                    continue
                text = record.get(self.text_key)
                if not isinstance(text, str):
                    self._skip("missing_text", where, f"(no string field {self.text_key!r}; fields: "
                               f"{sorted(record)[:8]}; set the source's text_key)")
                    continue
                yield Document(text=text, id=f"{self.source}:{filepath}:{li}",
                               metadata={"source": self.source})


class TextFolderSource(_AllFilesMixin, BaseDiskReader):
    """A folder of .txt files, one document per file."""

    name = "📄 Text files"

    def __init__(self, data_folder, glob_pattern: str | None = None, source: str = "", **kwargs):
        super().__init__(data_folder, glob_pattern=glob_pattern, **kwargs)
        self.source = source

    def read_file(self, filepath: str):
        with self.data_folder.open(filepath, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            self._skip("invalid_utf8", filepath, f"({err.reason} at byte {err.start})")
            return
        yield Document(text=text, id=f"{self.source}:{filepath}", metadata={"source": self.source})


def _tabular(reader_cls, source: str, text_key: str):
    """A datatrove tabular reader (Parquet, Arrow IPC) that reads all files and tags the source."""

    class Tabular(_AllFilesMixin, reader_cls):
        def get_document_from_dict(self, data: dict, source_file: str, id_in_file):
            text = data.get(self.text_key)
            if not isinstance(text, str):
                self._skip("missing_text", f"{source_file} row {id_in_file}", f"(no string field "
                           f"{self.text_key!r}; fields: {sorted(data)[:8]}; set the source's text_key)")
                return None
            return Document(text=text, id=f"{source}:{source_file}:{id_in_file}", metadata={"source": source})

    Tabular.__name__ = f"{reader_cls.__name__}Source"
    return Tabular


def make_reader(path: Path, fmt: str, text_key: str, source: str, progress: bool = False):
    """The reader step for one source."""
    folder, glob = (path, None) if path.is_dir() else (path.parent, path.name)
    if fmt == "jsonl":
        return JsonlSource(str(folder), glob_pattern=glob or "**/*.json*", text_key=text_key, source=source,
                           doc_progress=progress)
    if fmt == "text":
        return TextFolderSource(str(folder), glob_pattern=glob or "**/*.txt", source=source, doc_progress=progress)
    if fmt == "parquet":
        from datatrove.pipeline.readers import ParquetReader

        return _tabular(ParquetReader, source, text_key)(str(folder), glob_pattern=glob or "**/*.parquet",
                                                         text_key=text_key, doc_progress=progress)
    if fmt == "hf_disk":  # `datasets.save_to_disk` writes Arrow IPC streams
        from datatrove.pipeline.readers.ipc import IpcReader

        return _tabular(IpcReader, source, text_key)(str(folder), glob_pattern=glob or "**/*.arrow", stream=True,
                                                     text_key=text_key, doc_progress=progress)
    raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
