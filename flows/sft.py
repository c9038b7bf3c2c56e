"""The flow `sft-difflm`: instruction tuning of a pretrained model, from its source to a tuned, registered model.

Adaptation's structure (`difflm.flows.adapt`): the source's HF folder as `train.init_from_hf`, then the flagship's
rows (`difflm.flows.pretrain.PRETRAIN_STAGES`): import of its weights -> data prep of the instruction data through
its tokenizer -> training from the imported weights (fresh optimizer; the objective's SFT settings on instruction
data) -> HF export -> evaluation -> registry. The evaluation row is SFT's own: the held-out instructions scored for
the tuned model and for the model before tuning, into one evaluation record (`difflm.tasks.sft.evaluate_sft`).
A stock source (Llama, Qwen2, ... or smollm2) is also exported as an `ar` model (adaptation's row), which is the
model before tuning. One MLflow run: the pretrained model as lineage (tags `source.*`: the folder, its sha256,
the pretrained run directory, MLflow run and registered version), carried to the registered version's tags and
description.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from prefect import flow, get_run_logger

from difflm import tracking
from difflm.config import PipelineConfig
from difflm.flows.adapt import EXPORT_SOURCE_AR
from difflm.flows.pretrain import EVALUATE, PRETRAIN_STAGES, run_pipeline
from difflm.flows.stages import PipelineRun
from difflm.tasks import sft
from difflm.tasks.cache import cache_key, eval_done, eval_key
from difflm.tasks.sources import is_stock_folder
from difflm.tasks.stages import evaluate_sft_task


@flow(name="sft-difflm", log_prints=True)
def sft_difflm(source: str, preset: str = sft.DEFAULT_PRESET, overrides: list[str] | None = None) -> dict:
    """Instruction-tune a pretrained model; evaluate it before and after on held-out instructions; register it.

    Args:
        source: a run directory (its export), an export folder, `models:/<name>/<version>` (or `@<alias>`), or an
            HF folder (Llama/Qwen2/Qwen3/Mistral; `smollm2`), imported first.
        preset: sft-tiny (the tests, CPU), sft-smollm2, or any preset/YAML path with instruction data.
        overrides: `section.field=value` overrides on top of the preset and the source's fields.
    """
    cfg, folder, lineage = sft.sft_config(source, preset, overrides)
    logger = get_run_logger()
    mode = cfg.diffusion.model_running_mode
    tags = {"preset": cfg.name, "mode": mode, "flow": "sft-difflm", **{f"source.{k}": v for k, v in lineage.items()}}
    stages: dict[str, str] = {}
    run_name = f"sft-{cfg.name}-{mode}-{cfg.data_label()}"
    with tracking.degradations() as degraded, tracking.pipeline_run(cfg, run_name, tags) as run_id:
        summary, run = run_pipeline(cfg, run_id, logger, stages, lineage, SFT_STAGES)
    before, after = sft.instruction_scores(run.results)
    if after:
        logger.info("\n".join(sft.before_after_lines(before, after)))
    return {
        **summary,
        "source": lineage,
        "checkpoint": str(run.imported.checkpoint),
        "instructions": {"before": before, "after": after},
        "tracking": tracking.summary_line(degraded),
    }


def _before(run: PipelineRun) -> str:
    """The model before tuning: the source's own export, or a stock source exported as `ar` from its import."""
    return str(run.source_hf.folder if run.has("source_hf") else run.source_lineage()["path"])


def _key(run: PipelineRun, out) -> str:
    return cache_key("evaluate-sft", eval_key(run.cfg, run.manifest, run.export.folder), _before(run))


# a stock source's `ar` export, after the import (it reads the imported checkpoint and the data's tokenizer)
EXPORT_STOCK_SOURCE = replace(EXPORT_SOURCE_AR, when=lambda run: is_stock_folder(Path(run.source_lineage()["path"])))
EVALUATE_SFT = replace(
    EVALUATE,
    task=evaluate_sft_task,
    key=_key,
    done=lambda run, out: eval_done(out, _key(run, out)),
    args=lambda run, out, key: (run.cfg, run.manifest, str(run.export.folder), _before(run), str(out), key),
    title="evaluation before and after SFT",
)
# the flagship's rows with SFT's evaluation, the stock source's export before it
SFT_STAGES = [*(stage for stage in PRETRAIN_STAGES if stage is not EVALUATE), EXPORT_STOCK_SOURCE, EVALUATE_SFT]


def sft_command(cfg: PipelineConfig, source: str, preset: str, overrides: list[str]) -> int:
    """`difflm sft SOURCE`: the flow, then its summary in the form of `difflm run`'s, the held-out exact match
    before and after; the summary is kept in <workdir>/last_sft.json."""
    from difflm.flows.commands import SUMMARY_KEYS, _fields, remembered

    summary = sft_difflm(source=source, preset=preset, overrides=overrides)
    ins = summary["instructions"]
    lines = ["\n=== sft-difflm done ==="]
    if ins["after"]:
        lines += sft.before_after_lines(ins["before"], ins["after"])
        lines += [
            f"sample: {s['prompt'][-60:]!r} -> {s['output']!r} (expected {s['target']!r})"
            for s in ins["after"]["samples"][:3]
        ]
    src = summary["source"]
    lines.append(
        "tuned from: "
        + ", ".join(f"{k} {src[k]}" for k in ("run_dir", "mlflow_run_id", "registered_version") if src.get(k))
        if any(src.get(k) for k in ("run_dir", "mlflow_run_id", "registered_version"))
        else f"tuned from: {src['path']}"
    )
    lines.append("stages: " + ", ".join(f"{k} {v}" for k, v in summary["stages"].items()))
    lines += _fields(summary, SUMMARY_KEYS)
    lines.append(remembered(cfg.model_copy(update={"workdir": summary["workdir"]})))  # the source's, by default
    print("\n".join(lines))
    Path(summary["workdir"], "last_sft.json").write_text(json.dumps(summary, indent=2, default=str))
    return 0
