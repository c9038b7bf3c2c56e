"""The `export` section: the engine layouts the pipeline writes besides its own export (`difflm convert --format`
does the same for any checkpoint; models/hf/engines.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from difflm.config.base import OPERATIONAL, _Section

EngineFormat = Literal["llada", "dream", "gguf"]


class ExportConfig(_Section):
    formats: list[EngineFormat] = Field(
        default_factory=list,
        description="Engine layouts the convert stage also writes the final checkpoint in, each into "
        "<run>/engines/<format>: llada (LLaDAModelLM, for difflm-noshift), dream (DreamModel, for difflm-shift), "
        "gguf (the mode's layout plus model.gguf, which llama.cpp's llama-diffusion-cli runs); each records its "
        "logits' parity against megatron's in its difflm_export.json. Empty: none (docs/engines.md).",
        json_schema_extra=OPERATIONAL,
    )
