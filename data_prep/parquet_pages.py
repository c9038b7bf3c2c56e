"""The pages of a Parquet column chunk, their sizes and value counts read from their headers, not the pages.

pyarrow decompresses a whole page to read any of its values and does not expose page headers, so they are read
here: each is a Thrift compact-protocol struct (parquet.thrift `PageHeader`: 1 type, 2 uncompressed_page_size,
3 compressed_page_size, 5/7/8 the data, dictionary or v2 data page header, whose field 1 is num_values) followed
by the page itself. A page holding more bytes than its values could hold at the record limit holds a value
over it, whatever the encoding (a text value never spans pages).
"""

from __future__ import annotations

import pyarrow as pa

_HEADER_READ = 1 << 10  # a header without statistics is ~30 bytes; one with min/max values is read in steps
_MAX_HEADER = 1 << 20  # a header longer than this is not a page header (statistics are capped far below it)
_MAX_DEPTH = 16


class _Short(Exception):
    """The bytes read so far end inside the header: read more."""


class _Thrift:
    """A reader of one Thrift compact-protocol struct from `buf` (only what a page header can hold)."""

    def __init__(self, buf: bytes):
        self.buf, self.pos = buf, 0

    def byte(self) -> int:
        if self.pos >= len(self.buf):
            raise _Short
        self.pos += 1
        return self.buf[self.pos - 1]

    def varint(self) -> int:
        shift = value = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise ValueError("varint longer than 64 bits")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, n: int) -> None:
        if n < 0:
            raise ValueError("negative length")
        self.pos += n
        if self.pos > len(self.buf):
            raise _Short

    def struct(self, depth: int = 0) -> dict:
        """The integer and struct fields of the struct at the current position (the others are read past)."""
        if depth > _MAX_DEPTH:
            raise ValueError("structs nested too deep")
        fields, last = {}, 0
        while True:
            head = self.byte()
            if head == 0:
                return fields
            kind, delta = head & 0x0F, head >> 4
            last = last + delta if delta else self.zigzag()
            if kind in (4, 5, 6):  # i16, i32, i64
                fields[last] = self.zigzag()
            elif kind == 12:
                fields[last] = self.struct(depth + 1)
            else:
                self.value(kind, depth)

    def value(self, kind: int, depth: int) -> None:
        if kind in (1, 2):  # a boolean field: the value is in the field header
            return
        if kind == 3:
            self.skip(1)
        elif kind in (4, 5, 6):
            self.varint()
        elif kind == 7:
            self.skip(8)
        elif kind == 8:
            self.skip(self.varint())
        elif kind in (9, 10):  # list, set
            head = self.byte()
            n = head >> 4 if head >> 4 != 15 else self.varint()
            for _ in range(n):
                if head & 0x0F in (1, 2):  # booleans in a list: one byte each
                    self.skip(1)
                else:
                    self.value(head & 0x0F, depth + 1)
        elif kind == 11:  # map
            n = self.varint()
            if n:
                types = self.byte()
                for _ in range(n):
                    self.value(types >> 4, depth + 1)
                    self.value(types & 0x0F, depth + 1)
        elif kind == 12:
            self.struct(depth + 1)
        else:
            raise ValueError(f"unknown Thrift type {kind}")


def _header(f, pos: int) -> tuple[int, dict]:
    """(length, fields) of the page header at byte `pos`."""
    size = _HEADER_READ
    while True:
        f.seek(pos)
        buf = f.read(size)
        reader = _Thrift(buf)
        try:
            fields = reader.struct()
        except _Short:
            if len(buf) < size or size >= _MAX_HEADER:
                raise pa.ArrowInvalid(f"Parquet page header at byte {pos} is cut off or too long") from None
            size *= 4
            continue
        except (ValueError, IndexError) as err:
            raise pa.ArrowInvalid(f"Parquet page header at byte {pos} cannot be read: {err}") from None
        sizes = [fields.get(2), fields.get(3)]
        if not all(isinstance(n, int) and n >= 0 for n in sizes):
            raise pa.ArrowInvalid(f"Parquet page header at byte {pos} has no page sizes")
        return reader.pos, fields


def pages(f, chunk) -> list[tuple[int, int]]:
    """(decompressed size, number of values) of each page (dictionary or data) of column chunk `chunk` (pyarrow's
    ColumnChunkMetaData) in the open binary file `f`."""
    start = chunk.data_page_offset
    if chunk.has_dictionary_page and chunk.dictionary_page_offset:
        start = min(start, chunk.dictionary_page_offset)
    end, pos, found = start + chunk.total_compressed_size, start, []
    while pos < end:
        length, fields = _header(f, pos)
        kind = next((fields[k] for k in (5, 7, 8) if isinstance(fields.get(k), dict)), {})
        found.append((fields[2], max(kind.get(1, 0), 0)))
        pos += length + fields[3]
    return found
