"""Download, once and with network access, the wheels the GPU check installs on an offline GPU machine.

    python benchmarks/gpu_wheels.py            # -> benchmarks/gpu_wheels/ (ignored by git, ~6 MB)

    python benchmarks/gpu_wheels.py --from-installed --dest DIR   # this Python's installed copies, repacked
                                                                  # (the CPU rehearsal of the GPU image)

The bare CUDA image the check runs in has Python 3.12, PyTorch, transformers, safetensors, tokenizers, numpy,
pyyaml and pytest, and nothing else of ours: megatron-core and pydantic (with its compiled core) come from
here, at the versions this environment runs, as Python 3.12 manylinux wheels, with typing-extensions (pydantic
2.14 needs >= 4.14; the image's may be older) and psutil (megatron's checkpoint save hangs without it). No
Transformer Engine: its wheel is ~276 MB and its torch extension compiles from source; the check measures the
`torch` backend. The folder is git-ignored: name it in the GPU run's `carry` (docs/gpu-check.md).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import subprocess
import sys
import zipfile
from importlib.metadata import distribution, version
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGES = (
    "megatron-core",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "psutil",
)
LIMIT_MB = 60


def pins() -> list[str]:
    """The versions installed here, so the GPU machine runs what the tests here ran."""
    return [f"{name}=={version(name)}" for name in PACKAGES]


def repack_installed(name: str, dest: Path) -> Path:
    """A wheel of the installed distribution `name` (its files as this Python has them, with a fresh RECORD).
    Only for the CPU rehearsal: compiled parts are this interpreter's, whatever the tag says."""
    dist = distribution(name)
    files = [f for f in dist.files or [] if "__pycache__" not in f.parts and not str(f).startswith("..")]
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    wheel = dest / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in files:
            if f.name == "RECORD" and f.parts[0] == info:
                continue
            path = Path(f.locate())
            if not path.is_file():
                continue
            data = path.read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            zf.writestr(str(f.as_posix()), data)
            record.append(f"{f.as_posix()},sha256={digest},{len(data)}")
        record.append(f"{info}/RECORD,,")
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", default=str(HERE / "gpu_wheels"), help="folder for the wheels")
    ap.add_argument("--python-version", default="3.12", help="the GPU image's Python")
    ap.add_argument(
        "--from-installed",
        action="store_true",
        help="repack this Python's installed copies instead of downloading (CPU rehearsal only)",
    )
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    if args.from_installed:
        for name in PACKAGES:
            print(repack_installed(name, dest).name)
        return 0
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        args.python_version,
        "--platform",
        "manylinux_2_28_x86_64",
        "--platform",
        "manylinux2014_x86_64",
        "--platform",
        "manylinux_2_17_x86_64",
        "-d",
        str(dest),
        *pins(),
    ]
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:6.2f} MB  {w.name}")
    print(f"{size:.1f} MB in {dest}")
    if size > LIMIT_MB:
        raise SystemExit(f"{size:.0f} MB is over the {LIMIT_MB} MB the check may carry")
    return 0


if __name__ == "__main__":
    sys.exit(main())
