"""`pip install .` into a fresh virtual environment: one top-level package of ours in site-packages, and the
commands a user runs (`difflm run`, `prefect deploy --all` with the packaged prefect.yaml) work from it, outside
any checkout.

The wheel is built from this checkout and installed without its dependencies; they come from the project's
.venv through a .pth file (a directory named in a .pth joins sys.path after the venv's own site-packages, and the
.pth files inside it, the editable install's among them, are not run), so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("models", "flows", "tasks", "data_prep", "configs")  # the checkout's folders, installed under difflm/


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=kw.pop("timeout", 600), **kw)


def _fresh_venv(tmp: Path) -> tuple[Path, Path]:
    """A venv with the wheel installed and .venv's packages reachable; (its python, its site-packages)."""
    wheels = tmp / "wheels"
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)]
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    purelib = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    )
    before = set(os.listdir(purelib))
    (wheel,) = wheels.glob("difflm_pipeline-*.whl")
    installed = _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)])
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    added = set(os.listdir(purelib)) - before
    assert added == {"difflm", f"difflm_pipeline-{wheel.name.split('-')[1]}.dist-info"}, sorted(added)
    (purelib / "zz_difflm_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python, purelib


def _clean_env(home: Path) -> dict[str, str]:
    """No PYTHONPATH (pytest's points at the checkout) and no checkout as the working directory."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | {"HOME": str(home), "DIFFLM_LONG_TEST_LOADED": env.get("DIFFLM_LONG_TEST_LOADED", "1")}


@pytest.mark.slow(
    reason="builds the wheel, installs it into a fresh venv and runs the whole test-tiny pipeline from it (about 50 s "
    "of the test's 90-140 s), then `prefect deploy --all` against a Prefect server"
)
def test_pip_install_adds_one_package_and_its_commands_work(tmp_path, prefect_server):
    python, purelib = _fresh_venv(tmp_path)
    pkg = purelib / "difflm"
    for folder in FOLDERS:  # copied in as folders, not links back into a checkout
        assert (pkg / folder).is_dir() and not (pkg / folder).is_symlink(), folder
    assert (pkg / "configs" / "test-tiny.yaml").is_file() and (pkg / "prefect.yaml").is_file()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = _clean_env(tmp_path / "home")

    where = _run(
        [
            str(python),
            "-c",
            "import difflm.flows.cli as c, difflm.models.diffusion as d; print(c.__file__, d.__file__)",
        ],
        cwd=outside,
        env=env,
    )
    assert where.returncode == 0 and str(ROOT) not in where.stdout and str(pkg) in where.stdout, (
        where.stdout + where.stderr
    )
    assert _run([str(python), "-c", "import models"], cwd=outside, env=env).returncode != 0  # no generic name

    run = _run(
        [str(python.parent / "difflm"), "run", "--preset", "test-tiny", f"workdir={tmp_path / 'work'}"],
        cwd=outside,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "stages: data-prep ran, train ran, convert ran, evaluate ran" in run.stdout, run.stdout[-3000:]

    server = prefect_server()
    penv = {**server.env, **{k: v for k, v in env.items() if not k.startswith("PREFECT_")}}
    penv = {k: v for k, v in penv.items() if k != "PYTHONPATH"}
    pool = _run(
        [str(python), "-m", "prefect", "work-pool", "create", "difflm", "--type", "process"], cwd=outside, env=penv
    )
    assert pool.returncode == 0, pool.stdout + pool.stderr
    deploy = _run(
        [str(python), "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(pkg / "prefect.yaml")],
        cwd=outside,
        env=penv,
        timeout=180,
    )
    assert deploy.returncode == 0, deploy.stdout[-4000:] + deploy.stderr[-4000:]
    for name in ("pretrain-difflm/tiny-cpu", "evaluate-latest/every-10-minutes"):
        shown = _run(
            [str(python), "-m", "prefect", "deployment", "inspect", name, "--output", "json"], cwd=outside, env=penv
        )
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert json.loads(shown.stdout)["entrypoint"].startswith("difflm.flows."), shown.stdout
