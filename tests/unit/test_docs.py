"""The documentation stays true: the site builds with warnings as errors (a broken link, a missing anchor or a page
left out of the nav fails), the README's links resolve, and user docs cite no internal review ids or paths."""

from __future__ import annotations

import logging
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
