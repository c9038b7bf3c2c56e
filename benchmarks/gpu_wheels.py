"""Download, once and with network access, the wheels the GPU check installs on an offline GPU machine.

    python benchmarks/gpu_wheels.py            # -> benchmarks/gpu_wheels/ (ignored by git, ~6 MB)

The bare CUDA image the check runs in has Python 3.12, PyTorch, transformers, safetensors, tokenizers, numpy,
pyyaml and pytest, and nothing else of ours: megatron-core and pydantic (with its compiled core) come from
here, at the versions this environment runs, as Python 3.12 manylinux wheels. No Transformer Engine: its
wheel is ~276 MB and its torch extension compiles from source; the check measures the `torch` backend.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGES = ("megatron-core", "pydantic", "pydantic-core", "annotated-types", "typing-inspection")
LIMIT_MB = 60


def pins() -> list[str]:
    """The versions installed here, so the GPU machine runs what the tests here ran."""
    return [f"{name}=={version(name)}" for name in PACKAGES]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", default=str(HERE / "gpu_wheels"), help="folder for the wheels")
    ap.add_argument("--python-version", default="3.12", help="the GPU image's Python")
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
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
