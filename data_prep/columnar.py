"""Parquet files and saved HF datasets (Arrow IPC streams), read in bounded memory whatever their shape.

Memory is bounded by what is materialized, not by the file's size: a KiB of Parquet can hold a 512 MiB text, or
one 30 MiB dictionary value that 1000 rows repeat (30 GB once expanded). So, before anything is copied:
- a text column that is not text (a number, a `list<string>`, ...) is never read: its rows are counted
  `skipped_non_string_text` (a null there counts as such too);
- a Parquet row group is not read when a page of its text column (sizes and value counts read from the page
  headers, `parquet_pages`) holds more bytes than its values could at `MAX_RECORD_BYTES` each (so one of them
  is over it), or decompresses to more than `MAX_PAGE_BYTES`: its rows are counted `skipped_oversize_record`.
  pyarrow decompresses a page whole to read any of its values, and writes 1024 values to a page whatever their
  size, so a file of legitimate long documents has pages of hundreds of MiB: the page cap is set for them, and
  reading such a file costs about twice its largest page;
- the others are read in record batches of the text column alone, sized so that a batch takes at most
  `_BATCH_BYTES` of memory even if every row is as large as the largest page (no value can be larger than its
  page, a dictionary value than the dictionary page); an Arrow stream is memory-mapped, so a batch's text is
  not read until it is used;
- each value's length is read from the Arrow offsets (a dictionary value counts for every row that repeats it):
  one over `MAX_RECORD_BYTES` is a counted `skipped_oversize_record`, never converted; the others count against
  `max_file_bytes` (`skipped_oversize_file` past it: the documents before are kept) and become Python strings
  one batch, or (in a batch holding more text than `_BATCH_BYTES`) one value, at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.readers.base import BaseDiskReader
from fsspec.implementations.local import LocalFileSystem

from difflm.data_prep.parquet_pages import pages
from difflm.data_prep.sharding import Piece
from difflm.data_prep.tolerant import MAX_FILE_BYTES, MAX_RECORD_BYTES, _OversizeFile, _TolerantMixin

# A Parquet page decompresses whole to read any of its values (the dictionary page too): a group with a larger
# page is not read. pyarrow writes 1024 values to a page, so this admits documents of 1 MiB on average.
MAX_PAGE_BYTES = 1 << 30
_LEVELS = 64  # what a value may add to a page beside its text: its length, its repetition and definition levels
_BATCH_BYTES = 64 << 20  # the most memory one record batch may take, whatever its rows hold
_BUILDER_GROWTH = 2  # Arrow's builders double their buffers: a batch of text takes up to twice its bytes
_BATCH_TARGET = 8 << 20  # what a batch aims at, from the group's average row


def _is_text(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        return _is_text(kind.value_type)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _lengths(values: pa.Array) -> list[int | None]:
    """The byte length of each value (None for a null), from the offsets: nothing is copied."""
    if pa.types.is_dictionary(values.type):
        return pc.binary_length(values.dictionary).take(values.indices).to_pylist()
    if pa.types.is_string_view(values.type):  # no binary_length kernel: a view's first 4 bytes are its length
        views = np.frombuffer(values.buffers()[1], np.int32)[values.offset * 4 :: 4][: len(values)]
        return [None if null else int(n) for n, null in zip(views, values.is_null().to_pylist())]
    return pc.binary_length(values).to_pylist()


def _page_problem(found: list[tuple[int, int]]) -> str | None:
    """Why pages (size, values) cannot be read in bounded memory, or None."""
    for size, values in found:
        if size > max(values, 1) * (MAX_RECORD_BYTES + _LEVELS):
            return f"a page of {size} bytes holds {values} values: one is over {MAX_RECORD_BYTES >> 20} MiB"
        if size > MAX_PAGE_BYTES:
            return f"a page of {size} bytes, over {MAX_PAGE_BYTES >> 20} MiB"
    return None


class _ColumnarMixin(_TolerantMixin):
    max_file_bytes = MAX_FILE_BYTES  # the expanded text of one file; per instance in tests

    def _not_text(self, kind: pa.DataType, where: str, rows: int) -> None:
        detail = f"(field {self.text_key!r} is {kind}, not a string: not read)"  # type: ignore[attr-defined]
        self._skip("non_string_text", where, detail, n=rows)

    def _texts(self, values: pa.Array, filepath: str, row: int) -> Iterator[tuple[str, str]]:
        """(where, text) of the usable values of one batch (`row`: the file's row of its first value)."""
        sizes = _lengths(values)
        usable = [s for s in sizes if s is not None and s <= MAX_RECORD_BYTES]
        # the common batch, small and without oversize values, is converted at once; any other value by value
        whole = values.to_pylist() if len(usable) == len(sizes) and sum(usable) <= _BATCH_BYTES else None
        for i, size in enumerate(sizes):
            where = f"{filepath} row {row + i}"
            if size is not None and size > MAX_RECORD_BYTES:
                self._skip("oversize_record", where, f"(a text of {size} bytes, over {MAX_RECORD_BYTES >> 20} MiB)")
                continue
            self._expanded += size or 0
            if self._expanded > self.max_file_bytes:
                raise _OversizeFile(row + i)
            value = whole[i] if whole is not None else values[i].as_py()
            text = self._usable_text({self.text_key: value}, where)  # type: ignore[attr-defined]
            if text is not None:
                yield where, self._repaired(text)

    def _capped(self, filepath: str, documents: DocumentsPipeline) -> DocumentsPipeline:
        """`documents` until the file's text goes past `max_file_bytes`: the rest of the file is one counted skip."""
        self._expanded = 0
        try:
            yield from documents
        except _OversizeFile as err:
            cap = self.max_file_bytes
            self._skip_file(
                filepath, f"(its texts expand past {cap} bytes at row {err.args[0]}: the rows before are kept)"
            )


class ParquetSource(_ColumnarMixin, BaseDiskReader):
    """Parquet files, the text column read in bounded batches, row group by row group."""

    name = "📒 Parquet (bounded)"

    def __init__(self, data_folder, glob_pattern: str | None = None, text_key: str = "text", source="", **kwargs):
        super().__init__(data_folder, glob_pattern=glob_pattern, text_key=text_key, **kwargs)
        self.source = source

    def _records(self, piece: Piece) -> DocumentsPipeline:
        return self._capped(piece.path, self._documents(piece.path))

    def _documents(self, filepath: str) -> DocumentsPipeline:
        key = self.text_key
        with (
            self.data_folder.open(filepath, "rb") as f,
            self.data_folder.open(filepath, "rb") as headers,  # a second handle: pyarrow seeks in the first
            pq.ParquetFile(f, buffer_size=1 << 20) as pqf,
        ):
            meta, schema = pqf.metadata, pqf.schema_arrow
            if key not in schema.names:
                fields = sorted(schema.names)[:8]
                detail = f"(no field {key!r}; fields: {fields}; set the source's text_key)"
                self._skip("missing_text", f"{filepath} row 0", detail, n=meta.num_rows)
                return
            if not _is_text(schema.field(key).type):
                self._not_text(schema.field(key).type, f"{filepath} row 0", meta.num_rows)
                return
            row = 0
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                batch = self._batch_rows(headers, meta.row_group(g), f"{filepath} row {row}", row)
                if not batch:
                    row += rows
                    continue
                for part in pqf.iter_batches(batch_size=batch, row_groups=[g], columns=[key]):
                    for where, text in self._texts(part.column(0), filepath, row):
                        yield Document(text=text, id=f"{self.source}:{where}", metadata={"source": self.source})
                    row += part.num_rows

    def _batch_rows(self, headers, group, where: str, row: int) -> int:
        """The rows of one record batch of row `group` (its metadata), from the pages of its text column in the
        open file `headers`; 0 when the group cannot be read in bounded memory (then its rows are counted)."""
        key, rows = self.text_key, group.num_rows
        chunks = [group.column(j) for j in range(group.num_columns)]
        chunks = [c for c in chunks if c.path_in_schema == key or c.path_in_schema.startswith(f"{key}.")]
        found = [p for c in chunks for p in pages(headers, c)]
        if problem := _page_problem(found):
            detail = f"({problem}: the row group of rows {row}-{row + rows - 1} is not read)"
            self._skip("oversize_record", where, detail, n=rows)
            return 0
        size, page = sum(c.total_uncompressed_size for c in chunks), max((p for p, _ in found), default=0)
        target = _BATCH_TARGET * rows // max(size, 1)  # rows of an average batch
        whole_pages = _BATCH_BYTES // max(_BUILDER_GROWTH * page, 1)  # pages' worth of text a batch may hold
        if any(c.has_dictionary_page for c in chunks) or whole_pages <= 2:
            # a dictionary value may repeat in every row: any row may expand to the largest page
            return max(1, min(target, whole_pages))
        # plain pages hold their values' bytes: k rows span at most k / (fewest values a page holds) + 2 pages, so
        # a batch of small documents is not cut to a few rows because the pages are large (1024 values each)
        counts = [v for _, v in found if v] or [1]
        fewest = min(counts[:-1] or counts)  # the chunk's last page may hold a few rows: it is one of the + 2
        return max(1, min(target, (whole_pages - 2) * fewest))


class ArrowSource(_ColumnarMixin, BaseDiskReader):
    """The Arrow IPC streams of a saved HF dataset (`datasets.save_to_disk`), memory-mapped, batch by batch."""

    name = "🪶 Arrow (bounded)"

    def __init__(self, data_folder, glob_pattern: str | None = None, text_key: str = "text", source="", **kwargs):
        super().__init__(data_folder, glob_pattern=glob_pattern, text_key=text_key, **kwargs)
        self.source = source

    @contextmanager
    def _open(self, filepath: str):
        """A local file memory-mapped (a batch's buffers are read when used, not when the batch is), else read."""
        if isinstance(self.data_folder.fs, LocalFileSystem):
            with pa.memory_map(self.data_folder.resolve_paths(filepath), "r") as f:
                yield f
        else:
            with self.data_folder.open(filepath, "rb") as f:
                yield f

    def _records(self, piece: Piece) -> DocumentsPipeline:
        return self._capped(piece.path, self._documents(piece.path))

    def _documents(self, filepath: str) -> DocumentsPipeline:
        key, row, kept = self.text_key, 0, 0
        with self._open(filepath) as f, pa.ipc.open_stream(f) as stream:
            for batch in stream:
                where = f"{filepath} row {row}"
                if key not in batch.schema.names:
                    fields = sorted(batch.schema.names)[:8]
                    detail = f"(no field {key!r}; fields: {fields}; set the source's text_key)"
                    self._skip("missing_text", where, detail, n=batch.num_rows)
                elif not _is_text(batch.schema.field(key).type):
                    self._not_text(batch.schema.field(key).type, where, batch.num_rows)
                else:
                    for _, text in self._texts(batch.column(key), filepath, row):
                        yield Document(
                            text=text, id=f"{self.source}:{filepath}:{kept}", metadata={"source": self.source}
                        )
                        kept += 1
                row += batch.num_rows
