"""evaluate-latest's room: score a training run's newest complete checkpoint while it trains, and remember the
scores by iteration (<run>/eval_latest/scores.json) so a scheduled call skips what it scored before. Where a score
goes in MLflow is `difflm.tracking.latest`; the flow is flows/evaluate_latest.py."""

from __future__ import annotations

import json
from pathlib import Path

from difflm.config import PipelineConfig
from difflm.manifest import DataManifest
from difflm.models.evaluation.likelihood import instruction_windows, likelihood_bound, validation_windows
from difflm.models.evaluation.protocol import environment, model_identity
from difflm.models.evaluation.record import EvalRecord
from difflm.models.evaluation.stages import check_tokenizer, eval_device, load_model, load_tokenizer, placement
from difflm.rundir import HF, RunDir
from difflm.tasks.conversion import export_checkpoint


def evaluated_scores(run: RunDir) -> dict[int, dict]:
    """{iteration: score record} of the checkpoints evaluate-latest has scored in this run."""
    path = run.scores
    return {int(k): v for k, v in json.loads(path.read_text()).items()} if path.exists() else {}


def remember_score(run: RunDir, record: dict) -> None:
    scores = {**evaluated_scores(run), int(record["iteration"]): record}
    path = run.scores
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")  # a scheduled run killed mid-write leaves the old file intact
    tmp.write_text(json.dumps({str(k): v for k, v in sorted(scores.items())}, indent=2))
    tmp.replace(path)


def export_newest(cfg: PipelineConfig, manifest: DataManifest, run: RunDir, attempts: int = 3) -> tuple[int, Path]:
    """(iteration, HF folder) of the run's newest complete checkpoint, exported to <run>/eval_latest/hf. Works
    while the trainer writes: an unfinished save is not named by checkpoints/latest, and a checkpoint pruned
    while being read is replaced by the newer one."""
    out = run.eval_latest / HF
    for _ in range(attempts):
        it = run.latest_iteration()
        if it is None:
            raise FileNotFoundError(f"{run.path} has no complete checkpoint yet")
        ckpt = run.checkpoint(it)
        done = run.export_of(ckpt)
        if done is not None:  # the final checkpoint, already exported by the pipeline: score that folder
            return it, done
        try:
            export_checkpoint(cfg, manifest, ckpt, out, it)
            return it, out
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"{run.path}: checkpoints were pruned faster than they could be read; run again")


def score_export_bound(
    cfg: PipelineConfig, manifest: DataManifest, hf_dir: Path, max_sequences: int, out_dir: Path | None = None
) -> dict:
    """The held-out likelihood bound (ELBO; exact NLL for ar) of an export on at most `max_sequences` windows:
    the cheap score of evaluate-latest (the same estimator as the full evaluation, a smaller budget). With
    `out_dir`, also its evaluation record there (results.json: the bound, the model's identity, the software)."""
    model, tok = load_model(hf_dir, *eval_device(cfg.eval)), load_tokenizer(hf_dir)
    check_tokenizer(model, manifest, hf_dir)
    windows = validation_windows(
        manifest,
        min(cfg.train.seq_length, model.config.max_position_embeddings),
        min(cfg.eval.max_sequences, max_sequences),
    )
    bound = likelihood_bound(
        model, windows, cfg, tokenizer=tok, instruction=instruction_windows(manifest, windows)
    ).to_dict()
    where = placement(model)
    if out_dir is not None:
        EvalRecord(
            mode=model.config.model_running_mode,
            data_hash=manifest.hash,
            export=str(hf_dir),
            device=where["device"],
            dtype=where["dtype"],
            device_name=where["device_name"],
            bounds={"trained": bound},
            model=model_identity(model, hf_dir),
            environment=environment(),
        ).write(out_dir)
    return {**bound, **where}
