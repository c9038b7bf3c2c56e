"""deploy/slurm_local.py without starting Slurm: it never uses a folder it did not write and never stops a process
that is not its folder's daemon (the cluster itself runs in tests/integration/test_slurm.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from deploy import slurm_local
from deploy.slurm_local import MARKER, LocalSlurm, SlurmUnavailable


def test_a_folder_it_did_not_write_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("someone else's")
    with pytest.raises(SlurmUnavailable, match="not empty and was not written by deploy.slurm_local"):
        slurm_local._prepare_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert slurm_local.down(tmp_path, echo=lambda _: None) == []  # no marker: not a cluster folder


@pytest.mark.integration  # starts two Python processes
def test_down_stops_only_processes_that_name_its_folder(tmp_path):
    c = LocalSlurm(tmp_path)
    slurm_local._prepare_dir(tmp_path)
    assert (tmp_path / MARKER).exists()
    sleeper = "import time; time.sleep(60)"
    other = subprocess.Popen([sys.executable, "-c", sleeper])  # a recycled pid, or another cluster's daemon
    mine = subprocess.Popen([sys.executable, "-c", sleeper, f"--socket={c.munge_socket}"])
    try:
        for daemon in ("slurmd-node1", "slurmctld"):
            c.pid_file(daemon).write_text(f"{other.pid}\n")
        c.pid_file("munged").write_text(f"{mine.pid}\n")
        while not any(str(c.munge_socket) in a for a in psutil.Process(mine.pid).cmdline()):  # exec'd yet
            time.sleep(0.01)
        assert slurm_local.down(tmp_path, echo=lambda _: None) == [mine.pid]
        assert mine.wait(10) is not None and psutil.Process(other.pid).is_running()
        assert (tmp_path / "state").is_dir()  # nothing deleted
    finally:
        other.kill()
        mine.kill()
        other.wait()
        mine.wait()


def test_the_config_keeps_everything_in_its_folder(tmp_path):
    c = LocalSlurm(tmp_path, nodes=["node1", "localhost"], ctld_port=16817, slurmd_ports=[16818, 16819])
    lines = c.slurm_conf().splitlines()
    conf = dict(line.split("=", 1) for line in lines if not line.startswith(("Node", "Part")))
    assert conf["AuthInfo"] == f"socket={tmp_path}/munge/munge.sock" and conf["SlurmctldPort"] == "16817"
    assert [line.split()[:3] for line in lines if line.startswith("NodeName")] == [
        ["NodeName=node1", "NodeAddr=127.0.0.1", "Port=16818"],
        ["NodeName=localhost", "NodeAddr=127.0.0.1", "Port=16819"],
    ]
    assert "PartitionName=debug Nodes=node1,localhost Default=YES" in c.slurm_conf()
    paths = [v for k, v in conf.items() if k.endswith(("Location", "Dir", "File"))]
    assert len(paths) == 6 and all(v.startswith(str(tmp_path)) for v in paths)
    assert conf["ProctrackType"] == "proctrack/linuxproc" and conf["JobRequeue"] == "1"
    assert c.env == {"SLURM_CONF": str(tmp_path / "slurm.conf")}


def test_why_it_cannot_run_says_what_to_do(monkeypatch):
    monkeypatch.setattr(slurm_local, "which", lambda program: None if program == "slurmctld" else "/usr/bin/x")
    assert "Slurm not installed (slurmctld missing): as root, `make slurm`" in slurm_local.unavailable()
    monkeypatch.setattr(slurm_local, "which", lambda program: "/usr/bin/x")
    monkeypatch.setattr(slurm_local.os, "geteuid", lambda: 1000)
    assert "runs its daemons as root" in slurm_local.unavailable() and not slurm_local.can_install()
    monkeypatch.setattr(slurm_local.os, "geteuid", lambda: 0)
    assert slurm_local.unavailable() is None
