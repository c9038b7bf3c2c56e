"""The `convert-checkpoint` flow: megatron checkpoint <-> Hugging Face folder, for any run directory (its newest
complete checkpoint), checkpoint folder or export. From the command line: `difflm convert SOURCE --flow`; as a
deployment: prefect.yaml's `convert` (entrypoint difflm.flows.convert:convert_checkpoint)."""

from __future__ import annotations

from typing import Literal

from prefect import flow

from difflm.config import PipelineConfig
from difflm.tasks.sources import conversion_source, stage_config
from difflm.tasks.stages import convert_source_task


@flow(name="convert-checkpoint", log_prints=True)
def convert_checkpoint(
    source: str,
    to: Literal["hf", "megatron"] | None = None,
    out_dir: str | None = None,
    preset: str | None = None,
    overrides: list[str] | None = None,
    config: PipelineConfig | None = None,
    format: Literal["difflm", "llada", "dream", "gguf"] = "difflm",
) -> dict:
    """Convert a checkpoint between megatron and Hugging Face.

    Args:
        source: a run directory (<workdir>/runs/<run>: its newest complete checkpoint), a megatron checkpoint
            (<run>/checkpoints/iter_XXXXXXX) or a Hugging Face export (e.g. <run>/hf).
        to: hf or megatron; inferred from the source when empty (a checkpoint goes to hf, an export to megatron).
        out_dir: where the result goes (default: <run>/exports/iter_XXXXXXX for a run's checkpoint, else next
            to the source as <name>-hf / <name>-megatron).
        preset: a preset in configs/ or a YAML path; empty: the run's own config.yaml when the source belongs
            to a run, else tiny-cpu. For HF -> megatron it sets the target layout (parallel.*) and architecture.
        overrides: `section.field=value` overrides applied on top.
        config: a complete configuration (replaces preset and overrides).
        format: a checkpoint's export layout: difflm (this project's), llada, dream (those engines' published
            layouts) or gguf (the mode's layout and its GGUF file, for llama.cpp); see docs/engines.md.
    """
    found = conversion_source(source, to)
    if config is None:
        cfg = stage_config(found.run, preset, overrides)
    else:
        cfg = config if isinstance(config, PipelineConfig) else PipelineConfig.model_validate(config)
    return convert_source_task(cfg, found, out_dir, format)
