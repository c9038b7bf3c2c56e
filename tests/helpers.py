"""Helpers the test modules import. Fixtures live in conftest.py, which pytest loads as a plugin: a test module
that imported it as a module would load it a second time."""

from __future__ import annotations

from pathlib import Path

from difflm.config import PipelineConfig, load_config


def tiny_config(workdir: Path, *overrides: str) -> PipelineConfig:
    """The test-tiny preset with its outputs under `workdir`, and `section.field=value` overrides."""
    return load_config("test-tiny", [f"workdir={workdir}", *overrides])
