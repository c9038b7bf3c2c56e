"""What the bare, offline GPU image needs before any section runs, and the child processes the sections start.

- The packages the image lacks (megatron-core, pydantic, a new enough typing-extensions, psutil) are installed
  from local wheels (`benchmarks/gpu_wheels.py` downloads them beforehand) into a target folder, no index.
- Every child (torchrun workers, trainers, pytest) runs in its own process group with its output in a log as it
  comes, a timeout, and a poll callback that moves its rows into the report while it runs.

Only the standard library at module level: this module runs before the wheels are installed (psutil is imported
where a child is stopped, after the install).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK_SCRIPT = ROOT / "benchmarks" / "gpu_check.py"

# module -> distribution: installed from the wheels when absent
NEEDED = {"megatron.core": "megatron-core", "pydantic": "pydantic", "psutil": "psutil"}
# distribution -> the oldest version that works (pydantic 2.14: `ImportError: Sentinel` with 4.12)
MIN_VERSIONS = {"typing-extensions": (4, 14)}
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_DATASETS_OFFLINE": "1",
}


def present(module: str) -> bool:
    """Whether `module` can be imported. find_spec of a submodule imports its parent package, and raises
    ModuleNotFoundError (does not return None) when that parent is absent: `megatron.core` without `megatron`."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def missing_packages() -> list[str]:
    """Distributions to install from the wheels: absent modules, and versions below MIN_VERSIONS."""
    missing = [pkg for mod, pkg in NEEDED.items() if not present(mod)]
    for dist, least in MIN_VERSIONS.items():
        try:
            have = version_tuple(version(dist))
        except PackageNotFoundError:
            have = ()
        if have < least:
            missing.append(dist)
    return missing


def has_pip() -> bool:
    """Asked of a child: find_spec("pip") in this process would switch setuptools' _distutils_hack to pip mode,
    and torch's cpp_extension (imported by megatron) then fails on `import setuptools`."""
    return subprocess.run([sys.executable, "-c", "import pip"], capture_output=True).returncode == 0


def install_wheels(wheels: Path, site: Path) -> None:
    """pip install --target (no index, no deps); an image without pip gets the wheels unpacked (a wheel is a zip
    of its site-packages files)."""
    found = sorted(wheels.glob("*.whl"))
    if has_pip():
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index"]
        cmd += ["--no-deps", "--find-links", str(wheels), "--target", str(site), *map(str, found)]
        subprocess.run(cmd, check=True)
        return
    site.mkdir(parents=True, exist_ok=True)
    for wheel in found:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)


def wheels_digest(wheels: Path) -> str:
    """What the wheels in `wheels` install, as a digest: each wheel's name and RECORD (its files' own sha256), not
    the zip's bytes, which a repacked wheel's timestamps change each time."""
    h = hashlib.sha256()
    for wheel in sorted(wheels.glob("*.whl")):
        h.update(wheel.name.encode())
        with zipfile.ZipFile(wheel) as zf:
            records = sorted(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
            h.update(b"".join(zf.read(n) for n in records) if records else wheel.read_bytes())
    return h.hexdigest()[:16]


def cached_site(wheels: Path, cache: Path) -> Path:
    """The wheels installed into `cache`/<wheels_digest>, once: a later run with the same wheels reuses the folder
    (the CPU rehearsal's cache, as the Docker test caches its images). The install goes to a folder of this process
    first and is renamed when complete, so a killed install never leaves a half site to reuse."""
    site = cache / wheels_digest(wheels)
    if site.is_dir():
        return site
    cache.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{site.name}-", dir=cache))
    try:
        install_wheels(wheels, partial)
        partial.rename(site)
    except OSError:
        if not site.is_dir():  # (else another run completed the same site first: use it)
            raise
    finally:
        if partial.exists():
            shutil.rmtree(partial)  # this process's own partial install
    return site


def ensure_dependencies(wheels: Path, site: Path, cache: Path | None = None) -> list[str]:
    """Install what the bare GPU image lacks from local wheels (no index, no network) into `site` (or a site
    `cache` holds for these wheels), first on sys.path and on the children's PYTHONPATH."""
    missing = missing_packages()
    if missing:
        if not wheels.is_dir() or not any(wheels.glob("*.whl")):
            raise SystemExit(
                f"missing {', '.join(missing)} and no wheels in {wheels}: run "
                f"`python benchmarks/gpu_wheels.py` on a machine with network access first, and carry "
                f"benchmarks/gpu_wheels to the GPU machine (it is git-ignored)"
            )
        if cache is None:
            install_wheels(wheels, site)
        else:
            site = cached_site(wheels, cache)
        sys.path.insert(0, str(site))
        importlib.invalidate_caches()
        for name in [m for m in sys.modules if m == "typing_extensions"]:
            del sys.modules[name]  # a copy imported before the install: take the wheel's
        still = missing_packages()
        if still:
            raise SystemExit(f"still missing after installing {wheels}: {', '.join(still)}")
    paths = [str(ROOT), *([str(site)] if missing else []), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return missing


def offline_environment() -> None:
    """This process and its children: no hub access (the export and load_hf run here), loopback sockets,
    unbuffered children (their logs are read while they run)."""
    for key, value in {
        **OFFLINE,
        "PYTHONUNBUFFERED": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }.items():
        os.environ.setdefault(key, value)


class SectionFailed(RuntimeError):
    """A section that failed with figures worth keeping."""

    def __init__(self, message: str, partial: dict):
        super().__init__(message)
        self.partial = partial


# ---- subprocesses ---------------------------------------------------------------------------------------
class Interrupted(BaseException):
    """SIGTERM / SIGINT to the check (an outer `timeout`): the section in flight is marked killed, the report
    written, the children stopped."""


def _stop(proc: subprocess.Popen) -> None:
    """The child and all its descendants (torchrun starts its worker in a session of its own): SIGTERM, then
    SIGKILL to what is left."""
    import psutil  # lazy: installed from the wheels when the image lacks it

    if proc.poll() is not None:
        return
    try:
        parent = psutil.Process(proc.pid)
        tree = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in tree:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, tree = psutil.wait_procs(tree, timeout=5)  # the trainer takes SIGTERM as preemption: no time for that
        if not tree:
            break
    proc.poll()


def run_logged(cmd: list[str], log: Path, timeout: float, poll=None) -> int:
    """Run `cmd` in its own process group with its output in `log` (written as it comes); `poll()` every
    second while it runs (rows to the report); stopped at `timeout` or when the check is interrupted."""
    deadline = time.time() + timeout
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            while True:
                try:
                    proc.wait(timeout=1)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if poll:
                    poll()
                if time.time() > deadline:
                    _stop(proc)
                    raise subprocess.TimeoutExpired(cmd, timeout)
        finally:
            _stop(proc)
    if poll:
        poll()
    return proc.returncode


def _tail(log: Path, n: int = 25) -> str:
    return "".join(log.read_text(errors="replace").splitlines(True)[-n:]) if log.exists() else ""


def torchrun(args: list[str], log: Path, timeout: float, poll=None) -> None:
    """One process under torchrun (the trainer's own launch path); the log keeps its output."""
    from difflm.models.launch.torchrun import free_port  # lazy: the repository's code, after the wheels' install

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        *args,
    ]
    code = run_logged(cmd, log, timeout, poll)
    if code:
        raise RuntimeError(f"exit {code}; last lines of {log}:\n{_tail(log)}")


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSON-lines file another process may be writing."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return rows


def worker(check, kind: str, manifest: Path, name: str | None = None, **extra) -> dict:
    """Run the check's `--worker KIND` under torchrun; returns the JSON it writes. Rows it appends to
    KIND-rows.jsonl reach the report as they come (section `name`). `extra`: --key value arguments."""
    out, p = check.out, check.p
    tag = extra.pop("tag", kind)  # one worker kind, several sections: their files apart
    result = out / f"{tag}.json"
    rows = out / f"{tag}-rows.jsonl"
    rows.unlink(missing_ok=True)
    cmd = [
        str(CHECK_SCRIPT),
        str(out),
        "--worker",
        kind,
        "--manifest",
        str(manifest),
        "--result",
        str(result),
        "--rows",
        str(rows),
        *(["--dry-run"] if p["dry"] else []),
        *(["--sdpa", check.report["sdpa_forced"]] if check.report.get("sdpa_forced") else []),
    ]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    torchrun(cmd, out / f"{tag}.log", check.timeout(), check.rows(name, rows) if name else None)
    return json.loads(result.read_text())
