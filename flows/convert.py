"""The `convert-checkpoint` flow: megatron checkpoint <-> Hugging Face folder, for any run directory (its newest
complete checkpoint), checkpoint folder or export. `python -m flows.convert SOURCE [--to hf|megatron] ...`."""

from __future__ import annotations

import argparse
import json
from typing import Literal, Optional

from prefect import flow

from difflm.config import PipelineConfig
from tasks.runs import conversion_source, stage_config
from tasks.stages import convert_source_task


@flow(name="convert-checkpoint", log_prints=True)
def convert_checkpoint(
    source: str,
    to: Optional[Literal["hf", "megatron"]] = None,
    out_dir: Optional[str] = None,
    preset: Optional[str] = None,
    overrides: Optional[list[str]] = None,
    config: Optional[PipelineConfig] = None,
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
    """
    found = conversion_source(source, to)
    if config is None:
        cfg = stage_config(found["run_dir"], preset, overrides)
    else:
        cfg = config if isinstance(config, PipelineConfig) else PipelineConfig.model_validate(config)
    return convert_source_task(cfg, found, out_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flows.convert", description=convert_checkpoint.description)
    p.add_argument("source")
    p.add_argument("--to", choices=["hf", "megatron"], default=None)
    p.add_argument("--out", default=None, help="output folder")
    p.add_argument("--preset", default=None, help="preset or YAML (default: the run's config.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = p.parse_args(argv)
    print(json.dumps(convert_checkpoint(source=args.source, to=args.to, out_dir=args.out, preset=args.preset,
                                        overrides=args.overrides), indent=2))


if __name__ == "__main__":
    main()
