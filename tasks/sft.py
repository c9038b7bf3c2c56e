"""Instruction tuning (`difflm sft`, flow `sft-difflm`): the source, its lineage, the config, and the evaluation of
the model before and after. Plain functions, testable without Prefect.

SFT is adaptation's structure (`difflm.tasks.adapt`): a source model, then continued training from its weights. The
source becomes an HF folder (a run directory's export, an export, a registered version downloaded from MLflow, or
a stock HF folder), which the pipeline imports (`train.init_from_hf`, the import stage) and trains from on
instruction data. The lineage adds to adaptation's (the folder's path, sha256, architecture) the pretrained run it
came from: its run directory, its MLflow run and its registered version, where they are known.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from difflm import tracking
from difflm.config import PipelineConfig, load_config
from difflm.errors import UserError
from difflm.manifest import DataManifest
from difflm.models.evaluation.instructions import (
    NoInstructionItems,
    before_after_lines,
    instruction_items,
    score_instructions,
)
from difflm.models.evaluation.record import EvalRecord
from difflm.models.evaluation.sources import resolve_export
from difflm.models.evaluation.stages import check_tokenizer, eval_device, load_model, load_tokenizer
from difflm.models.hf.examples import EXAMPLE_SOURCES
from difflm.rundir import RunDir, exported_from, in_source_workdir
from difflm.tasks import adapt
from difflm.tasks.sources import is_stock_folder

__all__ = ["before_after_lines"]  # where the flow and the command read it

DEFAULT_PRESET = "sft-tiny"
SAMPLES_KEPT = 8  # generations kept in the record per model (every item is scored)


def resolve_sft_source(source: str, cfg: PipelineConfig) -> Path:
    """The HF folder of `source`: a run directory's export (`<run>/hf`), an export, `models:/<name>/<version>` or
    `models:/<name>@<alias>` (downloaded from `cfg`'s MLflow store, with the registry's trust checks), a stock HF
    folder or `smollm2` (imported by the pipeline as `difflm adapt` imports it)."""
    if source in EXAMPLE_SOURCES:
        return adapt.resolve_source(source)
    if source.startswith("models:/"):
        return resolve_export(source, tracking.tracking_uri(cfg), cfg.tracking)
    path = Path(source).expanduser().resolve()
    if is_stock_folder(path):
        return adapt.resolve_source(str(path))
    return resolve_export(str(path)).resolve()


def sft_config(source: str, preset: str, overrides: list[str] | None) -> tuple[PipelineConfig, Path, dict]:
    """(config, source folder, lineage). The preset, the fields the source fixes (architecture, tokenizer,
    `train.init_from_hf`: `adapt.adaptation_config`), then the user's overrides. Without a `workdir=` override, a
    source inside a workdir (a run directory or its export) tunes into that workdir: the SFT run, its MLflow run and
    its registered version sit beside the pretrained ones."""
    overrides = in_source_workdir(source, list(overrides or []))
    folder = resolve_sft_source(source, load_config(preset, overrides))  # a models:/ source: from this store
    cfg, _ = adapt.adaptation_config(str(folder), preset, overrides)
    if cfg.data.kind != "instruction":
        raise UserError(
            f"difflm sft tunes on instruction data, and preset {preset} reads {cfg.data.kind} data: pass "
            "data.kind=instruction with instruction sources (e.g. data.sources=[demo:instructions]), or --preset sft-tiny"
        )
    return cfg, folder, pretrained_lineage(source, folder, cfg)


def pretrained_lineage(source: str, folder: Path, cfg: PipelineConfig) -> dict[str, str]:
    """adapt.source_lineage(folder) (path, sha256, architecture, model_type), and where known: `run_dir` (the
    pretrained run directory), `checkpoint` (the one exported), `mlflow_run_id` (the pipeline run that trained it)
    and `registered_version` (`<name>/<version>`)."""
    lineage = adapt.source_lineage(folder)
    checkpoint = exported_from(folder)
    if checkpoint:
        lineage["checkpoint"] = checkpoint
    run = RunDir.holding(Path(checkpoint)) if checkpoint else RunDir.holding(folder)
    if run is not None:
        lineage["run_dir"] = str(run.path)
    found = _registered(source, cfg) if source.startswith("models:/") else _trained_by(run)
    lineage.update({k: v for k, v in (found or {}).items() if v})
    return lineage


@tracking.tolerant
def _registered(source: str, cfg: PipelineConfig) -> dict[str, str]:
    """The registered version `source` names, and the MLflow run that logged it."""
    from mlflow.tracking import MlflowClient  # mlflow takes seconds to import: only for a models:/ source

    tracking.use_store(tracking.tracking_uri(cfg))
    client = MlflowClient()
    name, _, ref = source[len("models:/") :].partition("/")
    if "@" in name:
        name, alias = name.split("@", 1)
        mv = client.get_model_version_by_alias(name, alias)
    else:
        mv = client.get_model_version(name, ref)
    return {"registered_version": f"{name}/{mv.version}", "mlflow_run_id": mv.run_id or ""}


@tracking.tolerant
def _trained_by(run: RunDir | None) -> dict[str, str] | None:
    """The pipeline run (its MLflow id) that trained `run`, in the store of the config it recorded, and the version
    it registered."""
    if run is None or not run.config_file.exists():
        return None
    cfg = run.config()
    if not cfg.tracking.enabled:
        return None
    from mlflow.tracking import MlflowClient  # as above

    uri = tracking.tracking_uri(cfg)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        return None  # no store there (a run trained without the pipeline): none is created by looking
    tracking.use_store(uri)
    run_id = tracking.training_mlflow_run(cfg, run)
    if not run_id:
        return None
    version = MlflowClient().get_run(run_id).data.tags.get("registered_model_version", "")
    return {"mlflow_run_id": run_id, "registered_version": version}


def evaluate_sft(
    cfg: PipelineConfig,
    manifest: DataManifest,
    record: EvalRecord,
    after_dir: Path,
    before_dir: Path,
    out_dir: Path,
    echo: Callable[[str], None] = print,
) -> EvalRecord:
    """`record` (the tuned model's evaluation) with the held-out instructions scored for the tuned model (task
    `instructions`) and for the model before tuning (the record's `baseline`: the same items, sampler and seed),
    written to `out_dir`."""
    try:
        items = instruction_items(manifest, cfg.eval.instruction_items)
    except NoInstructionItems as err:
        echo(f"[eval] {err}: nothing to score before and after")
        return record
    if not items:
        echo("[eval] no held-out instruction items: nothing to score before and after")
        return record
    scores = {}
    for role, folder in (("after", after_dir), ("before", before_dir)):
        echo(f"[eval] held-out instructions, {role} SFT: {len(items)} items ({folder})")
        model, tok = load_model(folder, *eval_device(cfg.eval)), load_tokenizer(folder)
        check_tokenizer(model, manifest, folder)
        scores[role] = {
            **score_instructions(model, tok, items, cfg.eval),
            "mode": model.config.model_running_mode,
            "export": str(folder),
        }
        scores[role]["samples"] = scores[role]["samples"][:SAMPLES_KEPT]
    after, before = scores["after"], scores["before"]
    tasks = {**record.tasks, "instructions": {k: v for k, v in after.items() if k not in ("mode", "export")}}
    # no `source` key: that is eval.baseline's AR row, which `difflm eval`'s reuse check compares with the config
    baseline = {
        "role": "the model before instruction tuning, on the same held-out instructions",
        **{k: before[k] for k in ("export", "mode", "exact_match", "nll_per_token", "items")},
        "instructions": before,
    }
    updated = record.replace(tasks=tasks, baseline=baseline)
    updated.write(out_dir)
    return updated.replace(report=record.report)


def instruction_scores(record: EvalRecord) -> tuple[dict | None, dict | None]:
    """(before, after) held-out instruction scores of an SFT evaluation record (None where not scored)."""
    after = record.tasks.get("instructions")
    before = (record.baseline or {}).get("instructions")
    return before, after
