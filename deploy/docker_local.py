"""A private Docker engine on this host, and image bases built without a registry, for the slow Docker test
(tests/integration/test_docker_compose.py) and for trying docker-compose.yml on a host that reaches no registry:

    python3 -m deploy.docker_local install       # apt-get install docker.io docker-compose debootstrap (root)
    python3 -m deploy.docker_local bases         # build the cached images (in the engine below when it runs,
                                                 # else in a private dockerd of its own, stopped after)
    python3 -m deploy.docker_local engine [--env-file .env]   # `make docker-engine`: a private dockerd on the
                                                 # cached images, left running; the bases built when missing, their
                                                 # names and build arguments set in .env; prints `export DOCKER_HOST=...`
    python3 -m deploy.docker_local stop          # stops that engine (its containers with it)

A temporary daemon has its own socket, exec root and pid file in a temporary folder, the engine in
<cache>/engine; both have their data root in a cache folder
(DIFFLM_DOCKER_CACHE, default ~/.cache/difflm/docker) so that the bases survive it: a Debian bookworm root
filesystem (`debootstrap --variant=minbase` from the host's Debian mirror, `docker import`ed), a Python 3.11 image
and a PostgreSQL 15 image on it (deploy/docker/*.Dockerfile), and the pipeline image's dependency and runtime stages
(everything but the project's own files). It is stopped by the pid in its pid file, never by name. Debian's clients are used (/usr/bin/docker, /usr/bin/docker-compose):
another `docker` may come first on PATH.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.env_file import set_values

ROOT = Path(__file__).resolve().parent.parent
DOCKER = "/usr/bin/docker"
COMPOSE = "/usr/bin/docker-compose"
DOCKERD = "/usr/sbin/dockerd"
DEBOOTSTRAP = "/usr/sbin/debootstrap"
PACKAGES = ("docker.io", "docker-compose", "debootstrap")
MINBASE = "local/bookworm:minbase"
PYTHON_BASE = "local/python:3.11-bookworm"
POSTGRES = "local/postgres:15-bookworm"
# the Dockerfile's stages before the project's files, each tagged with a hash of pyproject.toml and the Dockerfile: a
# cache that survives the test's removal of the pipeline image
DEPS = "local/difflm-deps"
RUNTIME = "local/difflm-runtime"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
TORCH_INDEX_PORT = 38953  # where a build on this host finds the torch wheel (see _TorchIndex)
DEFAULT_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # the Dockerfile's TORCH_INDEX_URL


class DockerUnavailable(RuntimeError):
    """No Docker engine can run here (not installed and not installable, or the daemon did not start)."""


def cache_dir() -> Path:
    return Path(os.environ.get("DIFFLM_DOCKER_CACHE") or Path.home() / ".cache" / "difflm" / "docker")


def missing_programs() -> list[str]:
    return [p for p in (DOCKER, COMPOSE, DOCKERD, DEBOOTSTRAP) if not os.access(p, os.X_OK)]


def unavailable() -> str | None:
    """Why a private engine cannot start here, with what to do (None: it can)."""
    missing = missing_programs()
    if missing:
        return (
            f"Docker not installed ({', '.join(missing)} missing): as root, `make docker` or `python -m "
            f"deploy.docker_local install` (apt-get install {' '.join(PACKAGES)})"
        )
    if os.geteuid() != 0:
        return "a private dockerd runs as root: run the Docker test as root"
    return None


def install(echo=print) -> bool:
    """The Debian packages, when missing and this process is root with apt-get; True when all are there."""
    if not missing_programs():
        return True
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False
    start = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "DEBCONF_NOWARNINGS": "yes"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            echo(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
            return False
    echo(f"installed {' '.join(PACKAGES)} in {time.monotonic() - start:.0f} s")
    return not missing_programs()


@dataclass
class Daemon:
    """A running private dockerd: its folder (socket, exec root, pid file, log) and the clients' environment."""

    root: Path
    data_root: Path
    lock: int | None = None  # an exclusive flock on the data root's lock file while the daemon runs

    @property
    def host(self) -> str:
        return f"unix://{self.root / 'docker.sock'}"

    @property
    def env(self) -> dict[str, str]:
        # DOCKER_CONFIG: a client config of our own (no credential helper or context of the host's user)
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_CONFIG": str(self.root / "client")}

    def docker(self, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        done = subprocess.run([DOCKER, *args], env=self.env, **kw)
        if check and done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:3])} failed ({done.returncode}): {(done.stderr or '')[-2000:]}")
        return done

    def has_image(self, ref: str) -> bool:
        return self.docker("image", "inspect", ref, check=False).returncode == 0


def start(root: Path, data_root: Path | None = None, timeout: float = 60, detach: bool = False) -> Daemon:
    """Start dockerd with its socket, exec root and pid file under `root` (short: a socket path has 107 bytes at
    most) and its images under `data_root` (default: the cache folder's data-root). `detach`: the daemon outlives
    this process and holds the data root's lock itself (it inherits the locked file)."""
    root, data_root = Path(root), Path(data_root or cache_dir() / "data-root")
    if len(str(root / "docker.sock")) > 100:
        raise DockerUnavailable(f"{root}: too long a path for the engine's socket; set DIFFLM_DOCKER_CACHE shorter")
    (root / "client").mkdir(parents=True, exist_ok=True)
    data_root.mkdir(parents=True, exist_ok=True)
    # one daemon per data root: a second test session waits here for the first one's daemon to stop
    lock = os.open(data_root.parent / f"{data_root.name}.lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    d = Daemon(root, data_root, lock)
    argv = [
        DOCKERD,
        "-H",
        d.host,
        "--data-root",
        str(data_root),
        "--exec-root",
        str(root / "exec"),
        "--pidfile",
        str(root / "docker.pid"),
        "--storage-driver",
        "overlay2",
    ]
    log = (root / "dockerd.log").open("ab")
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(lock,) if detach else ()
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (root / "dockerd.log").read_text(errors="replace")[-1500:]
            raise DockerUnavailable(f"dockerd exited with {proc.returncode}: {tail}")
        if d.docker("version", check=False).returncode == 0:
            if detach:  # the daemon's copy of the locked file keeps the lock until it exits
                os.close(lock)
                d.lock = None
            return d
        time.sleep(0.5)
    stop(d)
    raise DockerUnavailable(f"dockerd not answering after {timeout:.0f} s; see {root / 'dockerd.log'}")


def stop(d: Daemon, grace: float = 30) -> None:
    """Stop this daemon only: SIGTERM to the pid of its pid file (its containers stop with it), then wait."""
    try:
        _stop(d.root / "docker.pid", grace)
        netns = d.root / "exec" / "netns" / "default"  # dockerd leaves its network namespace mounted
        if os.path.ismount(netns):
            subprocess.run(["umount", str(netns)], check=False)
    finally:
        if d.lock is not None:
            os.close(d.lock)  # releases the flock
            d.lock = None


def _stop(pidfile: Path, grace: float) -> None:
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return  # already gone
    if str(pidfile).encode() not in cmdline:
        return  # the pid was reused: not our daemon
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
        except ChildProcessError:
            pass
        time.sleep(0.2)
    if Path(f"/proc/{pid}").exists():
        os.kill(pid, signal.SIGKILL)


def debian_mirror() -> str:
    """The Debian mirror apt uses here (sources.list or deb822 .sources), else deb.debian.org."""
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for f in files:
        try:
            text = f.read_text()
        except OSError:
            continue
        for url in re.findall(r"(?:^deb\s+(?:\[[^]]*\]\s+)?|^URIs:\s*)(\S+)", text, re.M):
            if url.rstrip("/").endswith("/debian") and url.startswith(("http://", "https://")):
                return url
    return DEFAULT_MIRROR


def ensure_minbase(d: Daemon, echo=print) -> None:
    """local/bookworm:minbase: debootstrap (about 2 minutes, once; the root filesystem stays in the cache)."""
    if d.has_image(MINBASE):
        return
    rootfs = cache_dir() / "rootfs"
    if not (rootfs / "etc" / "debian_version").exists() or not (rootfs / ".complete").exists():
        shutil.rmtree(rootfs, ignore_errors=True)  # our own half-made cache folder
        t = time.monotonic()
        subprocess.run(
            [DEBOOTSTRAP, "--variant=minbase", "bookworm", str(rootfs), debian_mirror()],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        (rootfs / ".complete").touch()
        echo(f"debootstrap bookworm minbase: {time.monotonic() - t:.0f} s")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--exclude=./.complete", "-c", "."], stdout=subprocess.PIPE)
    d.docker("import", "-", MINBASE, stdin=tar.stdout)
    tar.wait()


def build_base(d: Daemon, tag: str, dockerfile: str, files: dict[str, Path], echo=print) -> None:
    """Build deploy/docker/<dockerfile> on the minbase, in a context of just `files`, on the host network (the
    Debian mirror); skipped when `tag` exists."""
    if d.has_image(tag):
        return
    t = time.monotonic()
    with tempfile.TemporaryDirectory() as ctx:
        for name, src in files.items():
            shutil.copy(src, Path(ctx) / name)
        d.docker(
            "build",
            "--network",
            "host",
            "--build-arg",
            f"FROM_IMAGE={MINBASE}",
            "-f",
            str(ROOT / "deploy" / "docker" / dockerfile),
            "-t",
            tag,
            ctx,
        )
    echo(f"built {tag}: {time.monotonic() - t:.0f} s")


def ensure_bases(d: Daemon, echo=print) -> None:
    ensure_minbase(d, echo)
    build_base(d, PYTHON_BASE, "python-base.Dockerfile", {"ca-certificates.crt": CA_BUNDLE}, echo)
    docker_dir = ROOT / "deploy" / "docker"
    build_base(
        d, POSTGRES, "postgres.Dockerfile", {"postgres-entrypoint.sh": docker_dir / "postgres-entrypoint.sh"}, echo
    )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's signature)
        pass


class _TorchIndex:
    """A PEP 503 index of one folder's torch wheels on 127.0.0.1, for builds on a host whose torch CPU wheel lies
    on disk (PIP_FIND_LINKS) and which does not reach download.pytorch.org."""

    def __init__(self, wheels: list[Path]):
        self.dir = tempfile.TemporaryDirectory()
        page = Path(self.dir.name) / "torch"
        page.mkdir()
        for w in wheels:
            os.symlink(w, page / w.name)
        links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in wheels)
        (page / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
        handler = lambda *a: _QuietHandler(*a, directory=self.dir.name)  # noqa: E731
        try:  # the URL is a build argument: the same one keeps the dependency layer's build cache valid
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", TORCH_INDEX_PORT), handler)
        except OSError:  # taken: any port (the dependency layer is then rebuilt)
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.dir.cleanup()


def local_torch_wheels() -> list[Path]:
    found = []
    for folder in os.environ.get("PIP_FIND_LINKS", "").split():
        found += sorted(Path(folder).glob("torch-2.13.0+cpu-cp311-*.whl")) if Path(folder).is_dir() else []
    return found


# how the stages are built: part of their tag, so that stages built another way (the docker CLI's context, whose
# layers Compose's build could not reuse) are replaced
STAGES_BUILT_BY = b"docker-compose build"


def stages_tag() -> str:
    """What the cached stages are built from: pyproject.toml (the dependencies), the Dockerfile, and how."""
    h = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "Dockerfile").read_bytes() + STAGES_BUILT_BY)
    return h.hexdigest()[:12]


def compose_build_stage(d: Daemon, target: str, tag: str, build_args: dict[str, str]) -> None:
    """The Dockerfile's stage `target` built as `tag` by Compose (Debian's docker-compose), not the docker CLI.
    The classic builder keys a COPY layer by the context's tar headers, and the two clients write them differently
    (the CLI leaves the owner's name out, docker-compose's docker-py writes it): stages the CLI built were rebuilt
    by `make stack-docker`'s build, which then asked an index this host cannot reach (issue 51). Built by the same
    client, docker-compose.yml's build finds every layer of these stages."""
    spec = {
        "services": {
            "stage": {
                "image": tag,
                "build": {"context": str(ROOT), "target": target, "network": "host", "args": build_args},
            }
        }
    }
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "stage.yml"
        file.write_text(json.dumps(spec))  # JSON is YAML
        argv = [COMPOSE, "-f", str(file), "-p", "difflmstages", "build", "--force-rm", "stage"]
        done = subprocess.run(argv, env=d.env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"docker-compose build of the {target} stage failed: {done.stdout[-1500:]}{done.stderr[-1500:]}"
        )


def build_pipeline(d: Daemon, tag: str | None = "difflm-pipeline:latest", echo=print) -> None:
    """The pipeline image on the local Python base; its dependency and runtime stages are kept as
    DEPS/RUNTIME:<stages_tag> (a cache that outlives `tag`; tag None builds only those). Pip reaches its index
    over the host network; the torch wheel comes from disk when PIP_FIND_LINKS has it."""
    cached = stages_tag()
    wheels = local_torch_wheels()
    index = _TorchIndex(wheels) if wheels else None
    args = ["--network", "host", "--build-arg", f"BASE_IMAGE={PYTHON_BASE}"]
    if index:
        args += ["--build-arg", f"TORCH_INDEX_URL={index.url}"]
    build_args = {"BASE_IMAGE": PYTHON_BASE, "TORCH_INDEX_URL": index.url if index else DEFAULT_TORCH_INDEX}
    if not d.has_image(f"{DEPS}:{cached}"):  # what `engine` sets in .env, so Compose's build finds this layer
        (cache_dir() / "build-args.env").write_text(f"TORCH_INDEX_URL={build_args['TORCH_INDEX_URL']}\n")
    builds = [("deps", f"{DEPS}:{cached}"), ("runtime", f"{RUNTIME}:{cached}")] + ([(None, tag)] if tag else [])
    try:
        for target, name in builds:
            if target and d.has_image(name):
                continue
            t = time.monotonic()
            if target:
                compose_build_stage(d, target, name, build_args)
            else:
                d.docker("build", *args, "-t", name, str(ROOT))
            echo(f"built {name}: {time.monotonic() - t:.0f} s")
    finally:
        if index:
            index.close()
    for repo in (DEPS, RUNTIME):
        for line in d.docker("images", "--format", "{{.Repository}}:{{.Tag}}", repo).stdout.split():
            if line != f"{repo}:{cached}":  # the stages of an older pyproject.toml or Dockerfile
                d.docker("rmi", line, check=False)


def torch_index_url() -> str:
    """The TORCH_INDEX_URL the cached dependency stage was built with (recorded by build_pipeline), else the one a
    build here would use: Compose must pass the same, or it rebuilds that stage from an index it cannot reach."""
    try:
        recorded = (cache_dir() / "build-args.env").read_text().strip().removeprefix("TORCH_INDEX_URL=")
    except OSError:
        recorded = ""
    return recorded or (f"http://127.0.0.1:{TORCH_INDEX_PORT}/" if local_torch_wheels() else DEFAULT_TORCH_INDEX)


def image_settings() -> dict[str, str]:
    """What docker-compose.yml needs in .env to build and run on the cached images instead of a registry's."""
    return {
        "DIFFLM_BASE_IMAGE": PYTHON_BASE,
        "DIFFLM_POSTGRES_IMAGE": POSTGRES,
        "DIFFLM_TORCH_INDEX_URL": torch_index_url(),
    }


def engine_daemon() -> Daemon:
    """The engine of `engine` (running or not): its folder in the cache, beside the data root."""
    return Daemon(cache_dir() / "engine", cache_dir() / "data-root")


def running_engine() -> Daemon | None:
    d = engine_daemon()
    if (d.root / "docker.sock").exists() and d.docker("version", check=False).returncode == 0:
        return d
    return None


def engine(env_file: Path, echo=print) -> Daemon:
    """The private engine, started unless it runs, left running; the cached images built in it when missing, and
    their names and the torch index of the dependency stage set in `env_file`."""
    d = running_engine()
    if d is None:
        d = engine_daemon()
        d.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        stop(d)  # one left from a daemon killed without its pid file removed: only when that pid is still ours
        d = start(d.root, d.data_root, detach=True)
        echo(f"started a Docker engine (dockerd) on {d.data_root}; its log: {d.root / 'dockerd.log'}")
    ensure_bases(d, echo)
    build_pipeline(d, tag=None, echo=echo)
    set_values(env_file, image_settings())
    echo(f"set {', '.join(image_settings())} in {env_file}; stop the engine: python3 -m deploy.docker_local stop")
    return d


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # the daemon is stopped by the `finally` below


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m deploy.docker_local", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["install", "bases", "engine", "stop"])
    p.add_argument("--env-file", type=Path, default=ROOT / ".env", help="engine: where to set the image names")
    a = p.parse_args(argv)
    if a.action == "install":
        return 0 if install() else 1
    if a.action == "stop":  # by the pid in its pid file, whether it still answers or not
        d = engine_daemon()
        stop(d)
        print(f"stopped the engine of {d.root} (when it ran); the cached images stay in {d.data_root}")
        return 0
    why = unavailable()
    if why:
        print(why)
        return 1
    if a.action == "engine":
        try:
            d = engine(a.env_file)
        except (DockerUnavailable, RuntimeError, subprocess.CalledProcessError) as err:
            print(f"the Docker engine did not come up: {str(err)[-1500:]}", file=sys.stderr)
            return 1
        print(f"export DOCKER_HOST={d.host}")  # last: the line to run before make stack-docker and docker-compose
        return 0
    t = time.monotonic()
    running = running_engine()
    if running:  # its data root is the cache: build there (a second daemon would wait for its lock)
        ensure_bases(running)
        build_pipeline(running, tag=None)
    else:
        signal.signal(signal.SIGTERM, _terminated)  # a test session that ends early stops this build and its daemon
        with tempfile.TemporaryDirectory(prefix="dkr-", dir="/tmp") as tmp:
            d = start(Path(tmp))
            try:
                ensure_bases(d)
                build_pipeline(d, tag=None)
            finally:
                stop(d)
    print(
        f"cached in {cache_dir() / 'data-root'} ({time.monotonic() - t:.0f} s): {MINBASE}, {PYTHON_BASE}, "
        f"{POSTGRES}, {DEPS}:{stages_tag()}, {RUNTIME}:{stages_tag()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
