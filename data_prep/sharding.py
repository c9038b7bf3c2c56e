"""Which bytes of the input each data-prep task reads: about 1/N of them, so reading costs O(corpus) for any N.

The files of a source, sorted by path, are laid end to end; task r of N owns the byte interval
[r * total / N, (r + 1) * total / N) of that line. A file that can be cut (uncompressed JSON lines) gives each
task the part of it inside the task's interval, read at record boundaries: a range owns the records whose first
byte lies in it (it starts after the first newline before its start and reads past its end to finish its last
record). Any other file (compressed, Parquet, Arrow, a .txt document) is read whole by the task whose interval
holds the file's middle byte. Every record is thus read by exactly one task, and the plan depends only on the
file names, their sizes and N: a rerun of a task reads the same records in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputFile:
    path: str
    size: int
    splittable: bool  # records can be found from any byte offset (uncompressed JSON lines)


@dataclass(frozen=True)
class Piece:
    """What one task reads of one file: bytes [start, end) cut at record boundaries, or the whole file."""

    path: str
    start: int = 0
    end: int | None = None  # None: the whole file

    @property
    def whole(self) -> bool:
        return self.end is None


def plan(files: list[InputFile], rank: int, world_size: int) -> list[Piece]:
    """The pieces task `rank` of `world_size` reads, in file order."""
    total = sum(f.size for f in files)
    lo, hi = total * rank // world_size, total * (rank + 1) // world_size
    pieces, offset = [], 0
    for f in files:
        if f.splittable and f.size:
            start, end = max(lo, offset), min(hi, offset + f.size)
            if start < end:
                piece = Piece(f.path, start - offset, end - offset)
                pieces.append(Piece(f.path) if (piece.start, piece.end) == (0, f.size) else piece)
        elif _owner(offset + f.size // 2, total, world_size) == rank:
            pieces.append(Piece(f.path))
        offset += f.size
    return pieces


def _owner(byte: int, total: int, world_size: int) -> int:
    """The task whose interval holds `byte` (the last one for bytes at or past the end: empty files)."""
    if byte >= total:
        return world_size - 1
    rank = byte * world_size // total
    # integer intervals: rank r owns [total*r//N, total*(r+1)//N), empty when N > total; the estimate is low
    while byte >= total * (rank + 1) // world_size:
        rank += 1
    return rank
