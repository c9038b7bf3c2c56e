"""Prefect tasks: thin wrappers over the plain stage functions (each testable without Prefect): data_prep's and
models' for the pipeline; `tasks/conversion.py` and `tasks/latest.py` for the stages that work on an existing run.

The tasks declare no cache policy: the flows attach Prefect's cache per call (`tasks/cache.py`), keyed by the
hash that names the stage's output folder and trusted only while that folder is complete; every stage function
also reuses its finished folder on its own, so wiping Prefect's state costs nothing but a fast reuse run.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from difflm.config import PipelineConfig
from difflm.data_prep.pipeline import prepare_data
from difflm.errors import DiffLMError
from difflm.manifest import DataManifest, TokenizerInfo
from difflm.models.evaluation.likelihood import KIND_LABELS
from difflm.models.evaluation.record import EvalRecord
from difflm.models.evaluation.report import write_comparison
from difflm.models.evaluation.stages import convert_checkpoint, evaluate_export, sweep_export
from difflm.models.hf.export import Export
from difflm.models.launch.kubernetes import submit_kubernetes
from difflm.models.launch.slurm import submit_slurm
from difflm.models.launch.torchrun import launch_training
from difflm.rundir import RunDir, TrainResult
from difflm.tasks import adapt, sft
from difflm.tasks.cache import eval_done
from difflm.tasks.conversion import convert_source
from difflm.tasks.latest import export_newest, score_export_bound
from difflm.tasks.sources import ConversionSource


@task(name="data-prep", cache_policy=NO_CACHE)
def data_prep_task(cfg: PipelineConfig) -> DataManifest:
    """Data prep (reused when done). Prefect's JSON result store keeps the manifest's JSON and reads it back as a
    DataManifest (`DataManifest.of` also reads a result stored by the release before it was typed: a dict)."""
    manifest = prepare_data(cfg)
    train, valid = manifest.split("train"), manifest.split("valid")
    get_run_logger().info(
        f"data: {train.documents} train docs / {train.tokens:,} tokens, "
        f"{valid.documents} valid docs / {valid.tokens:,} tokens -> {manifest.dir}"
    )
    return manifest


def _resumable(task, task_run, state) -> bool:
    """Retry training when a rerun resumes usefully: a preemption or a crashed/killed trainer (locally, or a cluster
    job that ended early: the retry submits a new job, or reattaches to one Slurm requeued); not a stop on
    non-finite values (the same data would fail the same way), an invalid setup, or a cluster that refused or
    never started the job (ClusterError)."""
    err = state.result(raise_on_failure=False)
    return isinstance(err, DiffLMError) and err.retryable


@task(name="train", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 30], retry_condition_fn=_resumable)
def train_task(cfg: PipelineConfig, manifest: DataManifest, env: dict[str, str]) -> TrainResult:
    """Train with `train.launch.launcher`: local torchrun, or a Slurm job / Kubernetes PyTorchJob submitted and waited for.
    Every launcher trains into the same run directory and returns its `TrainResult`."""
    logger = get_run_logger()
    if cfg.train.launch.launcher == "slurm":
        return submit_slurm(cfg, manifest, echo=logger.info, env=env)
    if cfg.train.launch.launcher == "kubernetes":
        return submit_kubernetes(cfg, manifest, echo=logger.info, env=env)
    return launch_training(cfg, manifest, env=env, echo=logger.info)


@task(name="import-hf", cache_policy=NO_CACHE)
def import_task(cfg: PipelineConfig, folder: str, out_dir: str, lineage: dict | None = None) -> adapt.ImportedSource:
    """A pretrained model's HF folder -> a megatron checkpoint of its weights (what `train.init_from` trains from)."""
    imported = adapt.import_source(cfg, Path(folder), Path(out_dir), lineage)
    get_run_logger().info(f"imported {folder} -> {imported.checkpoint}")
    return imported


@task(name="export-source-ar", cache_policy=NO_CACHE)
def export_source_task(cfg: PipelineConfig, tokenizer: TokenizerInfo, ckpt: str, out_dir: str, lineage: dict) -> Export:
    """The imported checkpoint as an `ar` export of this project's class: the source model's evaluation input."""
    return adapt.export_source_ar(cfg, tokenizer, Path(ckpt), Path(out_dir), lineage)


@task(name="convert-to-hf", cache_policy=NO_CACHE)
def convert_task(cfg: PipelineConfig, manifest: DataManifest, trained: TrainResult) -> Export:
    export = convert_checkpoint(cfg, manifest, trained)
    get_run_logger().info(f"Hugging Face export: {export.folder}")
    return export


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(
    cfg: PipelineConfig,
    manifest: DataManifest,
    hf_dir: str,
    out_dir: str | None = None,
    untrained: bool = True,
    reuse_key: str | None = None,
) -> EvalRecord:
    """Evaluate the export; with `reuse_key`, results already in `out_dir` for that key are read back instead
    (as training reuses a finished run: a Prefect cache in another place, e.g. a deployment's worker, must not
    cost a new evaluation)."""
    if reuse_key and out_dir and eval_done(Path(out_dir), reuse_key):
        get_run_logger().info(f"reusing the evaluation in {out_dir} (same export, data and eval settings)")
        report = write_comparison(Path(cfg.workdir).resolve(), manifest.hash)
        return EvalRecord.read(out_dir).replace(report=str(report))
    results = evaluate_export(
        cfg, manifest, Path(hf_dir), Path(out_dir) if out_dir else None, untrained, echo=get_run_logger().info
    )
    b = results.bounds
    kind = KIND_LABELS[b["trained"]["kind"]]
    get_run_logger().info(
        f"validation {kind}: trained {b['trained']['ppl']:.1f}"
        + (f" vs untrained {b['untrained']['ppl']:.1f}" if "untrained" in b else "")
        + f" (on {results.device}, {results.dtype})"
    )
    for name, scores in results.tasks.items():
        get_run_logger().info(
            f"task {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items() if isinstance(v, float))
        )
    return results


@task(name="evaluate-sft", cache_policy=NO_CACHE)
def evaluate_sft_task(
    cfg: PipelineConfig, manifest: DataManifest, hf_dir: str, before_dir: str, out_dir: str, reuse_key: str
) -> EvalRecord:
    """The tuned export evaluated as `evaluate_task` does, then the held-out instructions scored for it and for the
    model before tuning (`before_dir`), into one record (`difflm.tasks.sft.evaluate_sft`); reused as evaluate's."""
    if eval_done(Path(out_dir), reuse_key):
        get_run_logger().info(f"reusing the evaluation in {out_dir} (same export, source, data and eval settings)")
        return EvalRecord.read(out_dir).replace(
            report=str(write_comparison(Path(cfg.workdir).resolve(), manifest.hash))
        )
    record = evaluate_task.fn(cfg, manifest, hf_dir, out_dir, False)
    logger = get_run_logger()
    record = sft.evaluate_sft(cfg, manifest, record, Path(hf_dir), Path(before_dir), Path(out_dir), logger.info)
    before, after = sft.instruction_scores(record)
    if after:
        logger.info(" / ".join(sft.before_after_lines(before, after)))
    return record


@task(name="sampler-sweep", cache_policy=NO_CACHE)
def sweep_task(cfg: PipelineConfig, manifest: DataManifest, hf_dir: str, out_dir: str) -> list[dict]:
    return sweep_export(cfg, manifest, Path(hf_dir), Path(out_dir))


@task(name="convert-checkpoint", cache_policy=NO_CACHE)
def convert_source_task(
    cfg: PipelineConfig, found: ConversionSource, out_dir: str | None = None, fmt: str = "difflm"
) -> dict:
    info = convert_source(cfg, found, out_dir, fmt)
    get_run_logger().info(
        f"{info['source']} -> {info['to']}: {info['out_dir']}"
        + (" (reused: already exported from this checkpoint)" if info["reused"] else "")
    )
    return info


@task(name="export-newest", cache_policy=NO_CACHE)
def export_newest_task(cfg: PipelineConfig, manifest: DataManifest, run: RunDir) -> tuple[int, str]:
    it, hf_dir = export_newest(cfg, manifest, run)
    return it, str(hf_dir)


@task(name="score-bound", cache_policy=NO_CACHE)
def score_bound_task(
    cfg: PipelineConfig, manifest: DataManifest, hf_dir: str, max_sequences: int, out_dir: str | None = None
) -> dict:
    score = score_export_bound(cfg, manifest, Path(hf_dir), max_sequences, Path(out_dir) if out_dir else None)
    get_run_logger().info(
        f"validation {KIND_LABELS[score['kind']]}: {score['ppl']:.2f} ({score['nll_per_token']:.4f} "
        f"nats/token, {score['sequences']} windows, on {score['device']})"
    )
    return score
