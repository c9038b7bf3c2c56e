"""The layout of the code: which package may import which, the pure diffusion maths, and old exports.

`models/` is four rooms with arrows (see `models/__init__.py` and the README's layout table); these tests
read every import statement (lazy ones inside functions included) and fail on an arrow the layout forbids.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difflm.models.hf.convert import export_code, load_hf
from difflm.models.hf.modeling_difflm import DiffLMForMaskedLM

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "export_before_layout_move"
STDLIB = set(sys.stdlib_module_names)


# the top-level folders of the checkout, installed as difflm.<name> (the links in difflm/ and pyproject.toml)
FOLDERS = ("models", "flows", "tasks", "data_prep")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in FOLDERS:
        parts.insert(0, "difflm")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names of every module `path` imports, relative imports resolved."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:  # `from pkg import mod` imports the module pkg.mod
                sub = ROOT.joinpath(*module.split("."), alias.name)
                is_module = sub.with_suffix(".py").exists() or (sub / "__init__.py").exists()
                names.add(f"{module}.{alias.name}" if is_module else module)
    return names


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _files(pattern: str) -> list[Path]:
    # not through difflm/'s links to the folders: each file once, under its folder's own rule
    files = sorted(f for f in ROOT.glob(pattern) if f.resolve() == f)
    assert files, f"no files match {pattern}: the layout this test describes has moved"
    return files


# (files, allowed: imports must be stdlib or start with one of these; None = no allow-list,
#  forbidden: imports that must not appear)
RULES = {
    "diffusion is pure torch": ("models/diffusion/*.py", ("torch", "difflm.models.diffusion"), ()),
    "exported model code: diffusion + transformers": (
        "models/hf/*_difflm.py",
        ("torch", "transformers", "difflm.models.diffusion", "difflm.models.hf.configuration_difflm"),
        (),
    ),
    "megatron never reaches up": (
        "models/megatron/*.py",
        None,
        (
            "difflm.models.hf",
            "difflm.models.evaluation",
            "difflm.models.launch",
            "transformers",
            "prefect",
            "difflm.flows",
            "difflm.tasks",
            "difflm.data_prep",
            "deploy",
            "difflm.tracking",
        ),
    ),
    "hf: no orchestration": (
        "models/hf/*.py",
        None,
        (
            "difflm.models.evaluation",
            "difflm.models.launch",
            "prefect",
            "mlflow",
            "difflm.flows",
            "difflm.tasks",
            "difflm.data_prep",
        ),
    ),
    "evaluation scores the export, not megatron": (
        "models/evaluation/*.py",
        None,
        ("difflm.models.megatron", "difflm.models.launch", "prefect", "mlflow", "difflm.flows", "difflm.tasks"),
    ),
    "launch: config and checkpoints only": (
        "models/launch/*.py",
        (
            "yaml",
            "psutil",
            "difflm.config",
            "difflm.credentials",
            "difflm.errors",
            "difflm.locks",
            "difflm.manifest",  # the data manifest a launch writes beside the run's config
            "difflm.rundir",
            "difflm.tracking.plots",
            "difflm.models.launch",
            "difflm.models.megatron.checkpointing",
        ),
        (),
    ),
    "difflm stands on difflm.models.diffusion only (the objectives' settings are its diffusion section)": (
        "difflm/**/*.py",
        None,
        (
            "difflm.models.megatron",
            "difflm.models.hf",
            "difflm.models.evaluation",
            "difflm.models.launch",
            "difflm.flows",
            "difflm.tasks",
            "difflm.data_prep",
            "deploy",
        ),
    ),
    "the config package: pydantic, yaml, difflm's base and the objectives' settings": (
        "difflm/config/*.py",
        ("pydantic", "yaml", "difflm.config", "difflm.errors", "difflm.models.diffusion"),
        (),
    ),
    "data_prep stands on difflm only": (
        "data_prep/*.py",
        None,
        ("difflm.models", "difflm.flows", "difflm.tasks", "deploy"),
    ),
    "tasks never import flows": ("tasks/*.py", None, ("difflm.flows", "deploy")),
    "flows (and the CLI, the top floor) never import ops tooling": ("flows/**/*.py", None, ("deploy", "benchmarks")),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_import_arrows(rule):
    pattern, allowed, forbidden = RULES[rule]
    bad = []
    for path in _files(pattern):
        for name in sorted(imports_of(path)):
            top = name.split(".")[0]
            if _within(name, forbidden) or (allowed is not None and top not in STDLIB and not _within(name, allowed)):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, f"{rule}:\n" + "\n".join(bad)


# The floors, bottom up. An import points at its own floor or one below, never up: the objectives' maths is the
# basement (the config's diffusion section is built from it), difflm's own modules the ground floor, then the rooms
# that do the work, then Prefect tasks, then the flows and the CLI on top.
FLOORS = (
    ("difflm.models.diffusion",),
    ("difflm",),
    ("difflm.data_prep", "difflm.models"),
    ("difflm.tasks",),
    ("difflm.flows",),
)


def floor_of(name: str) -> int | None:
    """The floor of one of our modules (the longest matching prefix), None for anything else."""
    best = None
    for level, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if _within(name, (p,)) and (best is None or len(p) > len(best[1])):
                best = (level, p)
    return best[0] if best else None


def _our_files() -> list[Path]:
    return [f for pattern in ("difflm/**/*.py", *(f"{d}/**/*.py" for d in FOLDERS)) for f in _files(pattern)]


def test_no_import_runs_back_up_a_floor():
    up = []
    for path in _our_files():
        here = floor_of(_module_name(path))
        for name in sorted(imports_of(path)):
            there = floor_of(name)
            if here is not None and there is not None and there > here:
                up.append(f"{path.relative_to(ROOT)} (floor {here}) imports {name} (floor {there})")
    assert not up, "imports that run back up a floor:\n" + "\n".join(up)


def test_the_floor_check_sees_an_arrow_up():
    assert floor_of("difflm.config.model") == 1 and floor_of("difflm.models.diffusion.modes") == 0
    assert (
        floor_of("difflm.models.megatron.gpt") == 2 and floor_of("difflm.flows.cli") == 4 and floor_of("torch") is None
    )


def _tracked_python() -> list[Path]:
    """Every Python file of the project: the packages, tests, benchmarks and ops tooling (not tests/fixtures: an
    export written by an older version, kept byte for byte)."""
    tops = ("difflm", *FOLDERS, "tests", "benchmarks", "deploy")
    return [f for top in tops for f in _files(f"{top}/**/*.py") if "fixtures" not in f.relative_to(ROOT).parts]


def test_nothing_imports_a_folder_by_its_checkout_name():
    """`import models` would load a second copy of every module beside difflm.models (two registries, two configs),
    and works only from a checkout: every import, and every module path in a string (`-m ...`, a patch target),
    names the installed package."""
    subs = {
        d: {p.stem for p in (ROOT / d).iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()} for d in FOLDERS
    }
    bad = []
    for path in _tracked_python():
        for name in imports_of(path):
            if name.split(".")[0] in FOLDERS:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            for quote in ("'", '"', "-m "):
                for d, names in subs.items():
                    bad += [
                        f"{path.relative_to(ROOT)}:{line_no}: {line.strip()}"
                        for s in names
                        if f"{quote}{d}.{s}" in line
                    ]
    assert not bad, "old module names:\n" + "\n".join(sorted(set(bad)))


def test_the_arrow_check_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function and a relative import are both seen."""
    fake = ROOT / "models" / "hf" / "modeling_difflm.py"
    names = imports_of(fake)
    assert "difflm.models.diffusion.modes" in names and "transformers" in names
    assert "difflm.models.megatron.distributed" in imports_of(ROOT / "models" / "hf" / "convert.py")  # a lazy one


BLOCKER = """
import importlib.abc, pkgutil, sys
BLOCKED = {"megatron", "transformers", "prefect", "mlflow", "datatrove", "safetensors"}
OURS = ("difflm", "difflm.models", "difflm.models.diffusion")  # the package's own floors above these are blocked
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        ours = name.startswith("difflm") and name not in OURS and not name.startswith("difflm.models.diffusion.")
        if name.split(".")[0] in BLOCKED or ours:
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
import torch
import difflm.models.diffusion as d
for info in pkgutil.iter_modules(d.__path__):
    __import__(f"difflm.models.diffusion.{info.name}")
x0 = torch.randint(3, 50, (2, 16))
nll = d.elbo_nll_per_token(lambda x: torch.zeros(*x.shape, 50), x0, 1, 2, torch.Generator().manual_seed(0))
print(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED or (m.startswith("difflm") and m not in OURS
             and not m.startswith("difflm.models.diffusion."))), round(float(nll.mean()), 4))
"""


@pytest.mark.integration  # a Python subprocess
def test_diffusion_imports_with_frameworks_blocked():
    out = subprocess.run([sys.executable, "-c", BLOCKER], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "3.912"]  # nothing blocked was loaded; ELBO of a uniform model = log 50


LIGHT_CONFIG = """
import sys
import difflm.config
print(sorted({m.split(".")[0] for m in sys.modules} & {"megatron", "transformers", "prefect", "mlflow"}))
"""


@pytest.mark.integration  # a Python subprocess
def test_the_config_stands_on_the_diffusion_floor_only():
    """The config builds its diffusion section from difflm.models.diffusion.modes: importing it stays light."""
    out = subprocess.run([sys.executable, "-c", LIGHT_CONFIG], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]"]


def test_export_ships_every_module_its_code_imports():
    code = export_code()
    for name, src in code.items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and f"{node.module}.py" in code, f"{name}: from {'.' * node.level}{node.module}"
    assert {"modeling_difflm.py", "configuration_difflm.py", "bounds.py", "samplers.py"} <= code.keys()


def _expected():
    return load_file(str(FIXTURE / "expected_outputs.safetensors"))


def _outputs(model, exp):
    x, t = exp["input_ids"], exp["t"]
    return (
        model(x, t=t).logits,
        model.elbo_nll(x, generator=torch.Generator().manual_seed(0), t_samples=4),
        model.diffusion_generate(x[:, :5], length=8, steps=4),
    )


def test_export_made_before_the_layout_move_still_loads():
    """An export written by the flat `models/` (commit 0c145af) loads with its own shipped code."""
    exp = _expected()
    logits, elbo, sample = _outputs(load_hf(FIXTURE), exp)
    assert torch.allclose(logits, exp["logits"], atol=1e-5)
    assert torch.allclose(elbo, exp["elbo_nll"], atol=1e-5)
    assert torch.equal(sample, exp["sample"])


def test_todays_model_code_computes_what_the_old_export_did():
    """The moved code gives the pre-move export's logits, ELBO and samples on the same weights."""
    exp = _expected()
    model = DiffLMForMaskedLM.from_pretrained(str(FIXTURE)).eval()
    logits, elbo, sample = _outputs(model, exp)
    assert torch.allclose(logits, exp["logits"], atol=1e-5)
    assert torch.allclose(elbo, exp["elbo_nll"], atol=1e-5)
    assert torch.equal(sample, exp["sample"])


@pytest.mark.slow
def test_train_step_benchmark_still_runs():
    """benchmarks/ import the trainer's internals: a tiny run keeps them from rotting unnoticed."""
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/train_step.py",
            "--presets",
            "tiny",
            "--steps",
            "1",
            "--seq",
            "32",
            "--batch",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "difflm-noshift" in out.stdout and "tokens/s" in out.stdout


def test_what_stages_hand_over_is_read_as_records_not_string_keys():
    """The data manifest and the pipeline's results are typed records (difflm.manifest, flows/stages.py's
    PipelineRun): no production module reads them by string key (`manifest["hash"]`, `run["trained"]`)."""
    pattern = re.compile(r"""\b(manifest|run)(\(\))?\[["']|\bmanifest\.get\(""")
    bad = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in [*_our_files(), *_files("benchmarks/**/*.py")]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not bad, "string-keyed reads of a record:\n" + "\n".join(bad)
