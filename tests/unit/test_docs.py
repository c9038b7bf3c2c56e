"""The documentation stays true: the site builds with warnings as errors (a broken link, a missing anchor or a page
left out of the nav fails), the README's links resolve, and user docs cite no internal review ids or paths."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
USER_DOCS = [README, *sorted((ROOT / "docs").glob("**/*.md"))]


def test_the_docs_site_builds_with_warnings_as_errors(tmp_path, monkeypatch):
    """What `make docs` runs (`mkdocs build --strict`), in process; the warnings are shown when it fails."""
    monkeypatch.chdir(ROOT)
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("mkdocs")
    logger.addHandler(handler)
    try:
        config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
        assert config.strict and config.validation.links.anchors == logging.WARNING
        try:
            build(config)
        except Abort:
            pytest.fail("mkdocs build --strict:\n" + "\n".join(warnings))
    finally:
        logger.removeHandler(handler)
    assert warnings == []
    assert (tmp_path / "site" / "testing" / "index.html").exists()


def test_the_readme_stays_short_and_its_relative_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(t.startswith("docs/") for t in targets)
    for target in targets:
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = target.split("#")[0]
        assert not path or (ROOT / path).exists(), f"README links to {target}, which does not exist"


@pytest.mark.parametrize("doc", USER_DOCS, ids=[str(p.relative_to(ROOT)) for p in USER_DOCS])
def test_user_docs_cite_no_review_ids_or_internal_paths(doc):
    text = doc.read_text()
    assert "../shared" not in text
    ids = re.findall(r"\b(?:review [A-Z]?\d+|[FM]\d\b)", text)
    assert not ids, f"{doc.name} cites review ids {ids}: say what the finding was instead"


PRESETS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_preset_comments_cite_only_files_of_the_project(preset):
    """A preset is read by users of a clone: a file its comments name must be in it (a cited recipe of another
    project is named by its project, not by a path)."""
    comments = " ".join(line.split("#", 1)[1] for line in preset.read_text().splitlines() if "#" in line)
    cited = re.findall(r"[\w.-]*/[\w./-]*\.(?:md|py|yaml|yml|json)\b", comments)
    missing = [c for c in cited if not (ROOT / c).exists() and not (ROOT / "docs" / c).exists()]
    assert not missing, f"{preset.name} cites files outside the project: {missing}"


def test_status_lists_as_missing_only_what_is_missing():
    """Block decoding reuses the finished blocks' keys and values (models/hf/modeling_difflm.py `kv_cache`)."""
    missing = next(p for p in (ROOT / "docs" / "status.md").read_text().split("\n- ") if "Not yet built" in p)
    assert "KV reuse across" not in missing and "diffusion blocks" not in missing, missing


def test_the_study_pages_half_life_lines_follow_from_its_own_table():
    """docs/study.md's CPU table, fitted as the study fits it (epochs seen: the steps over the 48,180 tokens of the
    48k budget), gives the half-life lines the page quotes: none for the AR arms, not identified for masked
    diffusion (whose four points fit R* = 0.5 about as well as R* = 10,000)."""
    from difflm.tasks.study import half_lives

    text = (ROOT / "docs" / "study.md").read_text()
    table = re.search(r"\| family \(bound\) \| 48k x 2 .*?\n\n", text, re.S)
    assert table, "docs/study.md: the CPU table is gone"
    rows = []
    for line in table.group(0).strip().splitlines()[2:]:
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        family, kind = cells[0].split(" (")
        for (budget, epochs), value in zip(((48000, 2), (48000, 6), (48000, 20), (48000, 60), (300000, 1)), cells[1:]):
            seen = math.ceil(epochs * 48180 / 2048) * 2048 / 48180 if budget == 48000 else 1.0
            rows.append(
                {
                    "family": family,
                    "unique_tokens": budget,
                    "epochs": epochs,
                    "epochs_seen": seen,
                    "validation_nll": float(value),
                    "kind": kind,
                }
            )
    lines = {fit.label: fit.line() for fit in half_lives(rows)}
    assert set(lines) == {"masked", "ar", "ar-strong", "ar-mir"}
    for family, line in lines.items():
        quoted = "not identified by these points" if family == "masked" else "absent (the validation loss does"
        assert line.startswith(f"data-reuse half-life: {quoted}"), (family, line)
        assert f"`{quoted}" in text, f"docs/study.md no longer quotes {quoted!r}"


def test_the_configuration_pages_bad_value_message_is_what_difflm_prints(capsys):
    """docs/configuration.md quotes the lines a wrong value and an unknown field give: the command it names prints
    them (`difflm config show` validates the same config as `difflm run`, before any work)."""
    from difflm.flows import cli

    text = (ROOT / "docs" / "configuration.md").read_text()
    command = re.search(r"\(`difflm run ([^`]+)`\):\n\n```\n(.*?)```", text, re.S)
    assert command, "docs/configuration.md: the quoted bad-value command and its output are gone"
    assert cli.main(["config", "show", *command.group(1).split()]) == 2
    assert capsys.readouterr().err == command.group(2)


@pytest.mark.parametrize("doc", [README, ROOT / "docs" / "demo.md"], ids=["README.md", "docs/demo.md"])
def test_the_quoted_end_of_a_run_has_every_line_difflm_run_prints(doc):
    """The README and the demo page quote the end of `difflm run`'s output: a line per summary field a run with a
    local MLflow store prints (flows/commands.py SUMMARY_KEYS; the two URL fields need a tracking server), in that
    order, and the last line naming the workdir of the preset quoted (test-tiny's)."""
    from difflm.config import load_config
    from difflm.flows.commands import SUMMARY_KEYS

    text = doc.read_text()
    start = text.index("=== pretrain-difflm done ===")
    block = text[start : text.index("```", start)].splitlines()
    fields = [line.split(":")[0].strip() for line in block if re.match(r"^ *\w+: ", line)]
    local = [k for k in SUMMARY_KEYS if k not in ("mlflow_run_url", "mlflow_curves_url")]
    assert [f for f in fields if f in SUMMARY_KEYS] == local, fields
    workdir = load_config("test-tiny").workdir
    assert block[-1].startswith(f"{'workdir':>16}: .../{workdir}  (named in "), block[-1]
    assert all(f".../{workdir}/" in line for line in block if "_dir: " in line)
