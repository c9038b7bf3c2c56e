"""One writer per output: an exclusive OS file lock (`fcntl.flock`) held while a process writes a stage's output
folder or creates a store.

The lock belongs to the open file, so it ends with the process however that ends (SIGKILL, OOM, a node reboot
for a local disk): nothing stale is ever left that stops the next run. The lock file stays (removing it would let
two processes lock two different files of one name); what it holds, the current holder's pid, host and start
time, is only read while the lock is held, to tell a second process who it waits for.

Across nodes, flock is as good as the shared filesystem's locks: NFSv4 and NFSv3 with the NLM lock manager
(Linux >= 2.6.12 turns flock into whole-file POSIX locks there), Lustre mounted with `-o flock`, GPFS/Spectrum
Scale, BeeGFS with `tuneUseGlobalFileLocks`, CephFS all lock across nodes. NFS mounted `nolock`/`local_lock=all`,
Lustre with `localflock` (or neither option: flock then fails, which is reported) and most FUSE filesystems
(sshfs, gcsfuse, s3fs) lock on one node only.

A thread may take a lock it already holds (re-entrant): the writers lock their own outputs (`prepare_data`,
`launch_training` and the cluster launchers, an export, an import), whether a command calls them alone or a pipeline stage that already
holds the same output's lock does. Another thread of the same process waits as another process does (two flocks on
two open files of one name exclude each other even within a process): a study's parallel points never share an
output.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from difflm.errors import UserError

ON_BUSY = ("wait", "fail")

_HELD = threading.local()  # .depth: {lock file's real path: how many `exclusive` of this thread hold it}


class OutputBusy(UserError):
    """Another process is writing the output this one asked for (and `on_busy` is `fail`)."""

    exit_code = 75  # EX_TEMPFAIL: the same command succeeds once the other process is done


def holder(fd: int) -> str:
    """Who holds the lock file open as `fd`, in words: 'pid 12 on node1 since 2026-12-05 15:50:03 UTC'. Read
    through the descriptor that was checked, not the name (which another user could swap for a link meanwhile)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0))
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info["since"]))
        return f"pid {info['pid']} on {info['host']} since {since}"
    except (OSError, ValueError, KeyError, TypeError):  # taken a moment ago: its holder has not written yet
        return "another process"


@contextmanager
def exclusive(
    lock_file: Path, what: str, on_busy: str = "wait", echo: Callable[[str], object] = print
) -> Iterator[None]:
    """Within: this process alone holds `lock_file` (for `what`, as the busy line names it). When another
    process holds it, one line says who; then wait for it (`on_busy='wait'`) or raise OutputBusy ('fail')."""
    if on_busy not in ON_BUSY:
        raise ValueError(f"on_busy must be one of {ON_BUSY}, not {on_busy!r}")
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    depth: dict[str, int] = _HELD.__dict__.setdefault("depth", {})
    key = os.path.realpath(lock_file)
    if depth.get(key):  # this thread holds it already (a pipeline stage around the writer it calls)
        depth[key] += 1
        try:
            yield
        finally:
            depth[key] -= 1
        return
    fd = open_lock_file(lock_file)
    try:
        if not _try_lock(fd, lock_file):
            line = f"{what} is being written by {holder(fd)} (lock {lock_file})"
            if on_busy == "fail":
                raise OutputBusy(f"{line}: run again when it has finished, or set pipeline.on_busy=wait to wait")
            echo(f"{line}: waiting for it, then reusing what it wrote")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.pwrite(fd, json.dumps(info).encode(), 0)
        depth[key] = 1
        try:
            yield
        finally:
            depth.pop(key, None)
    finally:
        os.close(fd)  # releases the lock


def open_lock_file(lock_file: Path) -> int:
    """Open (or create) the lock file as a plain file of ours only. Its holder's pid is written into it, so a
    planted link (`O_NOFOLLOW`), a hard link to another file, a fifo or device, or another user's file would have
    that write land somewhere it must not: each is refused in one line naming what to remove. O_NONBLOCK and
    O_NOCTTY so that opening a planted fifo or terminal returns at once instead of hanging or taking it over."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    fix = f"remove {lock_file} if no difflm process is running for it (a lock file is made anew when missing)"
    try:
        fd = os.open(lock_file, flags, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UserError(
                f"refusing the lock file {lock_file}: it is a symlink, not a file difflm made: {fix}"
            ) from err
        raise
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "it is not a regular file"
    elif st.st_uid != os.geteuid():
        why = f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif st.st_nlink != 1:
        why = f"it has {st.st_nlink} hard links (another name points at the same file)"
    if why:
        os.close(fd)
        raise UserError(f"refusing the lock file {lock_file}: {why}: {fix}")
    return fd


def _try_lock(fd: int, lock_file: Path) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise UserError(
                f"the filesystem of {lock_file} does not support file locks ({err.strerror}): put the workdir on "
                "one that does (a local disk, NFSv4, Lustre mounted with -o flock)"
            ) from err
        raise
