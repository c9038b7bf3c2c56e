"""Writing an output folder without ever deleting one that is not ours.

An output is built in a fresh private folder next to it (created here, so removing it on failure removes
nothing else), then swapped in: the earlier output, only when it carries our marker file, is renamed aside,
the new one renamed into place, and the old one deleted. Between the two renames the output never points at
a half-written folder, and a folder without the marker (a dataset that happens to hold `metadata.json`, a
run's checkpoint) is never touched: the caller refuses before any work (`check_replaceable`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from difflm.errors import UserError


class OutputInTheWay(UserError, FileExistsError):
    """The output path holds something this pipeline did not write: it is left alone."""


def check_replaceable(out_dir: Path, marker: str, what: str) -> None:
    """`out_dir` may be (re)written: it does not exist, is an empty folder, or holds an earlier output carrying
    `marker` (a file only this pipeline writes). Anything else raises before any work."""
    out_dir = Path(out_dir)
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if out_dir.is_dir() and not out_dir.is_symlink():
        if not any(out_dir.iterdir()) or (out_dir / marker).is_file():
            return
    raise OutputInTheWay(
        f"{out_dir} exists and is not {what} written by difflm (no {marker} in it): it would be replaced, so "
        f"nothing was written; pass a new or empty folder as the output (nothing in it was deleted)"
    )


@contextmanager
def private_umask() -> Iterator[None]:
    """No access for others (group keeps read) to what is written inside, and by the processes started inside;
    the caller's umask comes back after (an in-process caller, e.g. a test, keeps its own)."""
    before = os.umask(0o027)
    os.umask(before | 0o027)
    try:
        yield
    finally:
        os.umask(before)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def staged_output(out_dir: Path, marker: str | None = None, what: str = "an output") -> Iterator[Path]:
    """Yield a new empty folder next to `out_dir` to write into; on success it replaces `out_dir` (whose
    earlier content must carry `marker`, when given, else it is refused and left alone), on failure it is
    removed. The new folder gets the mode a plain mkdir would."""
    out_dir = Path(out_dir)
    if marker:
        check_replaceable(out_dir, marker, what)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.part-", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        if marker:
            check_replaceable(out_dir, marker, what)  # again: something may have appeared meanwhile
            if not (tmp / marker).is_file():
                raise RuntimeError(f"{tmp}: the output was written without its marker {marker}")
        aside = None
        if out_dir.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.replace(aside / "old")
        try:
            tmp.replace(out_dir)
        except OSError:
            if aside is not None:
                (aside / "old").replace(out_dir)  # put the earlier output back
            raise
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)  # ours: created above
