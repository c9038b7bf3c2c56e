"""One writer per output (`difflm.locks`): a second process is told who holds the lock, waits or fails, and a
holder killed with SIGKILL leaves nothing that stops the next one."""

import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from difflm.errors import UserError
from difflm.locks import OutputBusy, exclusive
from difflm.rundir import lock_file

# a child that takes the lock as `exclusive` does (flock on the file, its pid/host/time written), says so, then
# holds it until its stdin closes
HOLDER = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode(), 0)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path):
    out = tmp_path / "runs" / "run-a"
    lock = lock_file(out)
    lock.parent.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "held\n"
    yield proc, out
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_the_lock_file_sits_beside_the_output_not_in_it(tmp_path):
    assert lock_file(tmp_path / "runs" / "run-a") == tmp_path / "runs" / ".run-a.lock"


@pytest.mark.integration  # a real second process (a python that only imports fcntl)
def test_a_busy_output_fails_at_once_with_one_line_naming_its_holder(holder):
    proc, out = holder
    t0 = time.monotonic()
    with pytest.raises(OutputBusy) as err, exclusive(lock_file(out), f"train output {out}", "fail"):
        pytest.fail("the lock was taken while another process held it")
    line = str(err.value)
    assert time.monotonic() - t0 < 2 and "\n" not in line
    assert f"pid {proc.pid} on {socket.gethostname()} since " in line and "UTC" in line and str(out) in line
    assert "pipeline.on_busy=wait" in line


@pytest.mark.integration  # a real second process (a python that only imports fcntl)
def test_a_second_writer_waits_for_the_first_then_holds_the_lock(holder):
    proc, out = holder
    lines = []

    def said(line: str) -> None:  # told who it waits for: now let the holder finish
        lines.append(line)
        proc.stdin.close()

    with exclusive(lock_file(out), "train output", "wait", said):
        assert proc.wait(timeout=10) == 0  # it held the lock until it ended
    assert len(lines) == 1 and f"pid {proc.pid}" in lines[0] and "waiting for it" in lines[0]


@pytest.mark.integration  # a real second process (a python that only imports fcntl)
def test_a_holder_killed_with_sigkill_leaves_nothing_that_stops_the_next_run(holder):
    proc, out = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert lock_file(out).exists()  # the file stays; its lock died with the process
    with exclusive(lock_file(out), "train output", "fail"):
        assert f'"pid": {os.getpid()}' in lock_file(out).read_text()


def test_within_one_process_the_lock_is_released_on_the_way_out(tmp_path):
    lock = lock_file(tmp_path / "data" / "abc")
    with pytest.raises(RuntimeError), exclusive(lock, "data-prep output", "fail"):
        raise RuntimeError("the stage failed")
    with exclusive(lock, "data-prep output", "fail"):  # free again after the failure
        pass


def test_a_thread_takes_a_lock_it_holds_again_and_keeps_it_until_the_outer_one_ends(tmp_path):
    """A writer (`prepare_data`, `launch_training`) locks its output itself, also when a pipeline stage already
    holds that lock around it: no deadlock, and the inner exit does not release the outer hold."""
    out = tmp_path / "runs" / "run-b"
    with exclusive(lock_file(out), "train stage", "fail"):
        with exclusive(lock_file(out), "launch_training", "fail"):
            pass
        # still held: an open file of another name for the same lock cannot take it
        fd = os.open(lock_file(out), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    with exclusive(lock_file(out), "train output", "fail"):  # released by the outer exit
        pass


def test_another_thread_of_the_process_waits_as_another_process_does(tmp_path):
    """A study trains points from threads of one process: two threads never write one output at once."""
    lock = lock_file(tmp_path / "runs" / "run-c")
    inside, events = threading.Event(), []

    def second() -> None:
        with exclusive(lock, "train output", "wait", lambda line: events.append("waits")):
            events.append("second in")

    with exclusive(lock, "train output", "fail"):
        inside.set()
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive() and events == ["waits"]
        events.append("first out")
    thread.join(timeout=10)
    assert events == ["waits", "first out", "second in"]


# issue 50 item 5: a lock file planted by someone else (a link to a file of ours, a fifo, a file of another
# user) is refused in one line naming what to remove; the file a link points to is never opened for writing


def test_a_planted_symlink_lock_is_refused_and_its_target_untouched(tmp_path):
    out = tmp_path / "runs" / "run-a"
    out.parent.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    lock_file(out).symlink_to(target)
    with pytest.raises(UserError) as err, exclusive(lock_file(out), f"train output {out}", "fail"):
        pytest.fail("the lock was taken through a symlink")
    assert target.read_text() == "keep me"
    line = str(err.value)
    assert "\n" not in line and "symlink" in line and f"remove {lock_file(out)}" in line


def test_a_lock_that_is_not_a_regular_file_is_refused(tmp_path):
    out = tmp_path / "run-a"
    os.mkfifo(lock_file(out))
    with pytest.raises(UserError) as err, exclusive(lock_file(out), f"train output {out}", "fail"):
        pytest.fail("a fifo was taken as the lock")
    assert "not a regular file" in str(err.value) and f"remove {lock_file(out)}" in str(err.value)


def test_a_hard_linked_lock_is_refused_and_its_other_name_untouched(tmp_path):
    out = tmp_path / "run-a"
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    os.link(target, lock_file(out))
    with pytest.raises(UserError) as err, exclusive(lock_file(out), f"train output {out}", "fail"):
        pytest.fail("a hard link was taken as the lock")
    assert target.read_text() == "keep me" and f"remove {lock_file(out)}" in str(err.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_lock_owned_by_another_user_is_refused(tmp_path):
    out = tmp_path / "run-a"
    lock_file(out).write_text("")
    os.chown(lock_file(out), 65534, 65534)
    with pytest.raises(UserError) as err, exclusive(lock_file(out), f"train output {out}", "fail"):
        pytest.fail("another user's lock file was taken")
    assert "owned by uid 65534" in str(err.value) and f"remove {lock_file(out)}" in str(err.value)
