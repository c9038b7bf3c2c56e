"""A real Slurm cluster on this host (munge + slurmctld + one slurmd per node, Debian's slurm-wlm), for the tests
and for trying `train.launch.launcher=slurm` or `data.executor=slurm` without a cluster:

    python -m deploy.slurm_local install                 # apt-get install slurm-wlm munge (root; ~30 s)
    python -m deploy.slurm_local up   [--dir .difflm-slurm] # prints `export SLURM_CONF=...` for the clients
    python -m deploy.slurm_local down [--dir .difflm-slurm]

Everything lives in the folder: the munge key and socket (its own munged, so a system munged is not touched),
slurm.conf, the controller's state, the spool, pid files and logs. Ports are free ones picked at `up`. Two nodes
when two names resolve to this host (its short hostname and `localhost`): `slurmd -N NAME`, each on its own port
at 127.0.0.1, so that a job of `--nodes=2` runs one task per "node" (multi-node rendezvous on one machine). The daemons run as root (SlurmUser=root), with `proctrack/linuxproc` and `task/none`:
no cgroups, which containers rarely delegate. `down` cancels the cluster's jobs and stops the three daemons by
the pids in the folder's pid files, after checking that each is this folder's daemon; it deletes nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

PACKAGES = ("slurm-wlm", "munge")
PROGRAMS = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
SBIN = ("/usr/sbin", "/sbin")  # the daemons: not on a non-root PATH
MARKER = ".difflm-slurm"  # written by `up`: a folder without it (and not empty) is never used
DEFAULT_DIR = ".difflm-slurm"


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not installed and not installable, or a daemon did not start)."""


def which(program: str) -> str | None:
    return shutil.which(program) or shutil.which(program, path=os.pathsep.join(SBIN))


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if which(p) is None]


def unavailable() -> str | None:
    """Why a local cluster cannot start here, with what to do (None: it can)."""
    missing = missing_programs()
    if missing:
        return (
            f"Slurm not installed ({', '.join(missing)} missing): as root, `make slurm` or `python -m "
            f"deploy.slurm_local install` (apt-get install slurm-wlm munge; `make test` does it)"
        )
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons as root (SlurmUser=root): run the Slurm tests as root"
    return None


def can_install() -> bool:
    """apt-get as root: what CI's machines (and these ones) allow."""
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def install(echo=print) -> bool:
    """Install the Debian packages when programs are missing and this process may; True when all are there."""
    if not missing_programs():
        return True
    if not can_install():
        return False
    start = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "DEBCONF_NOWARNINGS": "yes"}
    quiet = {"env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "text": True}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
    ):
        proc = subprocess.run(cmd, **quiet)
        if proc.returncode != 0:
            echo(f"{' '.join(cmd[:2])} failed: {proc.stderr.strip()[-500:]}")
            return False
    echo(f"slurm-wlm and munge installed in {time.monotonic() - start:.0f} s")
    return not missing_programs()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    """What the node declares: below the host's memory, or slurmd drains the node (Low RealMemory)."""
    return max(1, int(psutil.virtual_memory().total / 2**20 * 0.9))


def node_names() -> list[str]:
    """Names that resolve to this host, one node each: the short hostname (what `scontrol show hostnames` gives
    the job's rendezvous) and `localhost`; one node when they are the same."""
    return list(dict.fromkeys([socket.gethostname().split(".")[0], "localhost"]))


@dataclass
class LocalSlurm:
    """Nodes at 127.0.0.1 (each its own slurmd and port), one partition `debug`, state under `root`."""

    root: Path
    nodes: list[str] = field(default_factory=node_names)
    ctld_port: int = 0
    slurmd_ports: list[int] = field(default_factory=list)
    # declared CPUs: at least 4 (config_overrides), so a training job and a few data-prep tasks run side by side
    # on a 2-core machine; the tests' jobs are tiny
    cpus: int = max(4, os.cpu_count() or 1)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.sock"

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, datatrove) needs to reach this cluster; jobs inherit it."""
        return {"SLURM_CONF": str(self.conf)}

    @property
    def daemons(self) -> list[str]:
        """Their pid files' names, in the order `down` stops them: the nodes, their controller, munge."""
        return [f"slurmd-{n}" for n in self.nodes] + ["slurmctld", "munged"]

    def pid_file(self, daemon: str) -> Path:
        return self.root / f"{daemon}.pid"

    def log_file(self, daemon: str) -> Path:
        return self.root / "log" / f"{daemon}.log"

    def slurm_conf(self) -> str:
        r = self.root
        nodes = [
            f"NodeName={n} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} RealMemory={_memory_mb()} State=UNKNOWN"
            for n, port in zip(self.nodes, self.slurmd_ports, strict=True)
        ]
        return "\n".join(
            [
                "ClusterName=difflm-local",
                f"SlurmctldHost={self.nodes[0]}(127.0.0.1)",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={self.munge_socket}",  # this folder's munged, not the system's
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "SchedulerType=sched/backfill",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "SlurmdParameters=config_overrides",  # the declared CPUs, whatever the host has
                "JobRequeue=1",
                "ReturnToService=2",
                "MpiDefault=none",
                "KillWait=30",  # what a step gets between SIGTERM and SIGKILL: the checkpoint of a preemption
                "MinJobAge=30",
                f"StateSaveLocation={r / 'state'}",
                f"SlurmdSpoolDir={r / 'spool' / '%n'}",  # %n: the node's name (slurmd -N)
                f"SlurmctldPidFile={self.pid_file('slurmctld')}",
                f"SlurmdPidFile={self.pid_file('slurmd-%n')}",
                f"SlurmctldLogFile={self.log_file('slurmctld')}",
                f"SlurmdLogFile={self.log_file('slurmd-%n')}",
                f"SlurmctldPort={self.ctld_port}",
                *nodes,
                f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
            ]
        )

    def clients_ok(self) -> bool:
        """Every node is idle (`sinfo` through this cluster's config)."""
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%t"], env={**os.environ, **self.env}, capture_output=True, text=True
        )
        return proc.returncode == 0 and proc.stdout.split() == ["idle"] * len(self.nodes)


def _prepare_dir(root: Path, nodes: tuple[str, ...] = ()) -> None:
    """Create `root` (or reuse one `up` wrote before); refuse a folder with other files in it."""
    if root.exists() and any(root.iterdir()) and not (root / MARKER).exists():
        raise SlurmUnavailable(f"{root} is not empty and was not written by deploy.slurm_local: choose another --dir")
    for sub in ("state", "spool", "log", "munge", *(f"spool/{n}" for n in nodes)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text("a local Slurm cluster of deploy/slurm_local.py\n")
    root.chmod(0o700)  # the munge key is in here


def _start_munged(c: LocalSlurm) -> None:
    key = c.root / "munge" / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
    cmd = [
        which("munged"),
        "--force",  # as root, in a folder munged finds too open for its liking: this cluster is single-host
        f"--socket={c.munge_socket}",
        f"--key-file={key}",
        f"--pid-file={c.pid_file('munged')}",
        f"--log-file={c.log_file('munged')}",
        f"--seed-file={c.root / 'munge' / 'munged.seed'}",
    ]
    _start(cmd, c, "munged")


def _start(cmd: list[str], c: LocalSlurm, daemon: str) -> None:
    """Start a daemon (it forks and writes its pid file) and wait for its pid file."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **c.env})
    if proc.returncode != 0:
        raise SlurmUnavailable(f"{daemon} did not start: {(proc.stderr or proc.stdout).strip()[-800:]}")
    _wait(lambda: _daemon(c, daemon) is not None, 10, f"{daemon} wrote no pid file ({c.log_file(daemon)})")


def _wait(predicate, timeout: float, why: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise SlurmUnavailable(why)
        time.sleep(0.2)


def _daemon(c: LocalSlurm, daemon: str) -> psutil.Process | None:
    """The running daemon of this cluster named by its pid file: its command line names this folder's config or
    socket (never a recycled pid, never another cluster's daemon)."""
    try:
        proc = psutil.Process(int(c.pid_file(daemon).read_text().split()[0]))
        mine = str(c.munge_socket) if daemon == "munged" else str(c.conf)
        return proc if any(mine in arg for arg in proc.cmdline()) else None
    except (OSError, ValueError, IndexError, psutil.Error):
        return None


def up(root: Path, echo=print) -> LocalSlurm:
    """Start munged, slurmctld and slurmd for `root` and wait until the node is idle."""
    missing = missing_programs()
    if missing:
        raise SlurmUnavailable(f"not installed: {', '.join(missing)} (python -m deploy.slurm_local install, as root)")
    root = root.resolve()
    c = LocalSlurm(root)
    if len(str(c.munge_socket)) > 100:  # a unix socket's path has at most 107 bytes
        raise SlurmUnavailable(f"{root} is too long a path for munge's socket in it: choose a shorter --dir")
    c.ctld_port, c.slurmd_ports = _free_port(), [_free_port() for _ in c.nodes]
    _prepare_dir(root, tuple(c.nodes))
    if any(_daemon(c, d) for d in _pid_files(c)):
        raise SlurmUnavailable(
            f"a cluster of {root} is already running: python -m deploy.slurm_local down --dir {root}"
        )
    c.conf.write_text(c.slurm_conf() + "\n")
    _start_munged(c)
    _start([which("slurmctld"), "-f", str(c.conf)], c, "slurmctld")
    for node in c.nodes:
        _start([which("slurmd"), "-f", str(c.conf), "-N", node], c, f"slurmd-{node}")
    _wait(c.clients_ok, 30, f"the nodes did not become idle: see {c.root / 'log'}")
    echo(f"Slurm is up: {c.conf} (nodes {', '.join(c.nodes)}; controller port {c.ctld_port})")
    return c


def _pid_files(c: LocalSlurm) -> list[str]:
    """The daemons whose pid files are in the folder (the nodes of an earlier `up` too), in stopping order."""
    nodes = sorted(p.stem for p in c.root.glob("slurmd-*.pid"))
    return list(dict.fromkeys([*nodes, *c.daemons]))


def _client(c: LocalSlurm, *cmd: str) -> str:
    """A Slurm client's output against this cluster ('' when it failed: `down` goes on stopping the daemons)."""
    try:
        proc = subprocess.run(cmd, env={**os.environ, **c.env}, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def down(root: Path, echo=print) -> list[int]:
    """Cancel the cluster's jobs, then stop its daemons; returns the pids stopped. Deletes nothing."""
    c = LocalSlurm(root.resolve())
    if not (c.root / MARKER).exists():
        return []
    if _daemon(c, "slurmctld"):  # jobs first: their steps are slurmstepd processes, outside the daemons
        _client(c, "scancel", "--full", "--state=RUNNING")
        _client(c, "scancel", "--state=PENDING")
        try:
            _wait(lambda: not _client(c, "squeue", "-h"), 40, "")
        except SlurmUnavailable:
            echo("jobs still completing; stopping the daemons anyway")
    procs = [p for p in (_daemon(c, d) for d in _pid_files(c)) if p is not None]
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=15)
    for proc in alive:
        proc.kill()
    stopped = [p.pid for p in procs]
    echo(f"Slurm of {c.root} stopped ({len(stopped)} daemons)")
    return stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.slurm_local", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["install", "up", "down"])
    parser.add_argument("--dir", type=Path, default=Path(DEFAULT_DIR), help=f"state folder (default: {DEFAULT_DIR})")
    args = parser.parse_args(argv)
    try:
        if args.command == "install":
            if install():
                return 0
            print(f"cannot install {' '.join(PACKAGES)} here (needs root and apt-get)", file=sys.stderr)
            return 1
        if args.command == "up":
            c = up(args.dir)
            print(f"export SLURM_CONF={c.conf}")
            return 0
        down(args.dir)
        return 0
    except SlurmUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
