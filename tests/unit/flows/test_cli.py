"""The command line: one table of commands, one spelling per verb, errors by type, and a fast `--help`."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from difflm.config import ConfigError, load_config, resolve_preset
from difflm.errors import DiffLMError, TrainingPreempted, UserError
from difflm.flows import cli
from difflm.models.evaluation.sources import SourceError

ROOT = Path(__file__).resolve().parents[3]


def test_every_command_of_the_table_explains_itself(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # no wrapping inside the phrases checked below
    names = [c.name for c in cli.COMMANDS]
    assert len(names) == len(set(names)) and "import-hf" not in names
    for cmd in cli.COMMANDS:
        assert cmd.help and cmd.description and callable(cmd.handler), cmd.name
        with pytest.raises(SystemExit) as exit_:
            cli.main([cmd.name, "--help"])
        out = capsys.readouterr().out
        assert exit_.value.code == 0 and "--preset" in out, cmd.name
        # one rule for the default, as each command states it
        expected = (
            f"the config.yaml the run recorded, else {cmd.default_preset}"
            if cmd.run_of
            else f"(default: {cmd.default_preset})"
        )
        assert expected in " ".join(out.split()), (cmd.name, out)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in names)


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["import-hf", "x", "--out", "y"], "use `difflm convert HF_DIR --out CKPT`"),
        (["convert", "x", "--to", "megatron"], "convert takes no --to: the direction follows from SOURCE"),
        (["serve", "--flow", "evaluate-latest"], "serve takes the flow as its first argument"),
    ],
)
def test_old_spellings_say_what_to_type_instead(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and hint in " ".join(capsys.readouterr().err.split())


@pytest.mark.integration  # a Python subprocess
def test_help_loads_no_framework():
    """Handlers import their stages lazily: `difflm --help` loads argparse and the config only."""
    code = (
        "import sys\nfrom difflm.flows.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = {'torch', 'prefect', 'mlflow', 'megatron', 'transformers', 'datatrove'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_options_that_set_config_fields_give_a_new_validated_config():
    cfg = load_config("tiny-cpu")
    assert cli.with_fields(cfg, {}) == cfg  # the dump round-trips
    new = cli.with_fields(cfg, {"train.launch.slurm.partition": "gpu", "train.launch.kubernetes.image": "img:2"})
    assert (new.train.launch.slurm.partition, new.train.launch.kubernetes.image) == ("gpu", "img:2")
    assert cfg.train.launch.slurm.partition != "gpu"  # the original is untouched
    with pytest.raises(ConfigError, match="train.launch.slurm.nodes|train.launch.slurm"):
        cli.with_fields(cfg, {"train.launch.slurm.nodes_typo": 1})


@pytest.mark.parametrize("error, code", [("TrainingPreempted", 75), ("ConfigError", 2), ("SourceError", 1)])
def test_exit_code_follows_the_error_type(error, code, monkeypatch, capsys):
    err = {
        "TrainingPreempted": TrainingPreempted("preempted at 4: rerun to resume", 4),
        "ConfigError": ConfigError("bad field"),
        "SourceError": SourceError("no such export"),
    }[error]

    def handler(cfg, args):
        raise err

    monkeypatch.setitem(cli.BY_NAME, "config", replace(cli.BY_NAME["config"], handler=handler))
    assert cli.main(["config", "show"]) == code
    captured = capsys.readouterr().err
    assert captured.startswith("difflm: ") and "Traceback" not in captured


def _error_classes() -> list[tuple[str, str]]:
    found = []
    for package in ("difflm", "data_prep", "models", "tasks", "flows"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                    found.append((module, node.name))
    return found


def test_every_error_the_pipeline_defines_is_a_user_error():
    """One hierarchy: the CLI catches UserError (no list of classes), Prefect retries by `retryable`."""
    classes = _error_classes()
    assert len(classes) >= 12, classes
    for module, name in classes:
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, DiffLMError), f"{module}.{name}"
        assert name == "DiffLMError" or issubclass(cls, UserError), f"{module}.{name} is not a UserError"


def _documented_commands() -> list[tuple[str, str]]:
    """(where, command line) for every `difflm ...` example in `difflm --help` and in fenced blocks of the docs."""
    found = [("difflm --help", line.strip()) for line in cli.EPILOG.splitlines() if line.strip().startswith("difflm ")]
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for doc in docs:
        fenced, pending = False, ""
        for n, raw in enumerate(doc.read_text().splitlines(), 1):
            if raw.lstrip().startswith("```"):
                fenced, pending = not fenced, ""
                continue
            line = pending + raw.strip()
            if fenced and line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            command = line.removeprefix(".venv/bin/")
            if fenced and command.startswith("difflm ") and "..." not in command:
                found.append((f"{doc.relative_to(ROOT)}:{n}", command))
    return found


def test_every_documented_example_parses_and_its_config_validates():
    """What a user copies from `--help` or the docs must at least parse and give a valid config (a test runs
    each command itself elsewhere; this one catches an example that drifted from the config's rules)."""
    examples = _documented_commands()
    assert len(examples) >= 10, examples
    for where, line in examples:
        argv = shlex.split(re.sub(r"<[^>]+>", "placeholder", line), comments=True)[1:]
        if argv == ["--help"]:
            continue
        args = cli._parse(argv)
        cmd = cli.BY_NAME[args.command]
        preset = args.preset or cli.DEFAULT_PRESET
        try:
            resolve_preset(preset)
        except Exception:  # a user's own file (my.yaml): the example is about its overrides
            preset = cli.DEFAULT_PRESET
        try:
            cfg = cli.load_config(preset, args.overrides)
            options = {a.sets: getattr(args, a.dest) for a in cmd.args if a.sets and getattr(args, a.dest) is not None}
            cli.with_fields(cfg, options)
        except Exception as err:
            pytest.fail(f"{where}: `{line}` fails: {err}")
