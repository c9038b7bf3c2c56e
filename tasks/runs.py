"""Plain functions of the stages that work on an existing training run, `convert-checkpoint` and
`evaluate-latest` (what `difflm convert` / `difflm eval-latest` call without Prefect; `tasks/stages.py` wraps them
as tasks): which folder a source is and where its conversion goes, a run's own config and data, the scores of
its checkpoints, and where in MLflow they belong."""

from __future__ import annotations

import json
from pathlib import Path

from data_prep.pipeline import prepare_data
from difflm.config import PipelineConfig


CONVERT_HINT = ("pass a run directory (<workdir>/runs/<run>: its newest complete checkpoint), a megatron checkpoint "
                "(<run>/checkpoints/iter_XXXXXXX, with metadata.json) or a Hugging Face export (config.json and "
                "model.safetensors, e.g. <run>/hf)")
EVAL_LATEST_DIR = "eval_latest"  # <run>/eval_latest/: hf/ (the export being scored) and scores.json


def _run_of(folder: Path) -> Path | None:
    """The training run directory holding `folder` (a checkpoint, or an export of one), if any."""
    marker = folder / "difflm_export.json"
    if marker.exists():  # an export names the checkpoint it came from
        ckpt = json.loads(marker.read_text()).get("checkpoint")
        folder = Path(ckpt) if ckpt else folder
    for run in (folder.parent, folder.parent.parent):
        if (run / "checkpoints").is_dir() and (run / "config.yaml").exists():
            return run
    return None


def conversion_source(source: str | Path, to: str | None = None) -> dict:
    """What `source` converts from: {'to': 'hf' | 'megatron', 'path': the folder to read, 'run_dir': the training
    run holding it (or None), 'iteration': the checkpoint's iteration (or None)}. A run directory means its newest
    complete checkpoint (`checkpoints/latest`, written only after a save finished). ConversionError otherwise."""
    from models.hf.convert import ConversionError
    from models.megatron.checkpointing import iter_dir, latest_iteration

    path = Path(source).expanduser().resolve()
    if not path.is_dir():
        raise ConversionError(f"{source}: no such folder; {CONVERT_HINT}")
    if path.name == "checkpoints" and (path.parent / "config.yaml").exists():
        path = path.parent
    if (path / "checkpoints").is_dir():
        it = latest_iteration(path / "checkpoints")
        if it is None:
            raise ConversionError(f"{path} is a run directory without a complete checkpoint yet (no checkpoints/"
                                  f"latest): wait for the first save (checkpoint.save_interval), or pass a checkpoint")
        found = {"to": "hf", "path": iter_dir(path / "checkpoints", it), "run_dir": path, "iteration": it}
    elif (path / "metadata.json").exists():
        digits = path.name.removeprefix("iter_")
        found = {"to": "hf", "path": path, "run_dir": _run_of(path),
                 "iteration": int(digits) if path.name.startswith("iter_") and digits.isdigit() else None}
    elif (path / "config.json").exists() and (path / "model.safetensors").exists():
        found = {"to": "megatron", "path": path, "run_dir": _run_of(path), "iteration": None}
    else:
        raise ConversionError(f"{source}: neither a run directory (checkpoints/), a megatron checkpoint "
                              f"(metadata.json) nor a Hugging Face export (config.json + model.safetensors); "
                              f"{CONVERT_HINT}")
    if to and to != found["to"]:
        what = "a Hugging Face export" if found["to"] == "megatron" else "a megatron checkpoint (or a run)"
        raise ConversionError(f"{source} is {what}: it converts to {found['to']}, not {to}; for {to}, pass "
                              + ("a run directory or a megatron checkpoint" if to == "hf" else "an HF export"))
    return found


def stage_config(run_dir: Path | None, preset: str | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """The config of a stage on an existing run: `preset` + overrides when a preset is given; else the run's own
    config.yaml (architecture and tokenizer settings as trained; workdir = the folder holding runs/, so MLflow is
    the training's store) + overrides; with neither, tiny-cpu + overrides."""
    from difflm.config import load_config

    if preset or run_dir is None or not (Path(run_dir) / "config.yaml").exists():
        return load_config(preset or "tiny-cpu", overrides or [])
    run_dir = Path(run_dir).resolve()
    workdir = [f"workdir={run_dir.parent.parent}"] if run_dir.parent.name == "runs" else []
    return load_config(str(run_dir / "config.yaml"), [*workdir, *(overrides or [])])


def run_manifest(run_dir: Path) -> dict:
    """The data manifest a run was trained on (its tokenizer, held-out split, hash)."""
    return json.loads((Path(run_dir) / "data_manifest.json").read_text())


def export_checkpoint(cfg: PipelineConfig, manifest: dict, ckpt: Path, out: Path, iteration: int | None) -> bool:
    """Export `ckpt` to `out` unless `out` already holds its export; True when reused. A checkpoint pruned by the
    trainer while being read (checkpoint.keep_last) gives FileNotFoundError, so callers can take the newer one."""
    from models.hf.convert import ConversionError, export_hf

    marker = out / "difflm_export.json"
    if marker.exists() and json.loads(marker.read_text()).get("checkpoint") == str(ckpt):
        return True
    provenance = {"data_hash": manifest["hash"], "mode": cfg.diffusion.model_running_mode, "iteration": iteration}
    try:
        export_hf(cfg, manifest["tokenizer"], ckpt, out, provenance)
    except Exception as err:
        if not ckpt.exists():
            raise FileNotFoundError(f"{ckpt} was removed while being read (the trainer keeps only "
                                    f"checkpoint.keep_last checkpoints): run again for the newer one") from err
        if isinstance(err, RuntimeError) and "size mismatch" in str(err):
            raise ConversionError(f"{ckpt} does not fit the model of this config ({cfg.name}: hidden "
                                  f"{cfg.model.hidden_size}, {cfg.model.num_layers} layers): pass the preset and "
                                  f"overrides it was trained with") from err
        raise
    return False


def existing_export(run_dir: str | Path, ckpt: str | Path) -> Path | None:
    """An HF folder of the run already exported from `ckpt` (the pipeline's hf/, an earlier conversion, the
    folder evaluate-latest scores), if any."""
    run_dir = Path(run_dir)
    for folder in (run_dir / "hf", run_dir / "exports" / Path(ckpt).name, run_dir / EVAL_LATEST_DIR / "hf"):
        marker = folder / "difflm_export.json"
        if marker.exists() and json.loads(marker.read_text()).get("checkpoint") == str(ckpt):
            return folder
    return None


def convert_source(cfg: PipelineConfig, found: dict, out_dir: str | Path | None = None) -> dict:
    """Convert what `conversion_source` found; the output goes to `out_dir`, else <run>/exports/iter_XXXXXXX for a
    run's checkpoint, else next to the source (<name>-hf, <name>-megatron). Returns where and what."""
    from data_prep.tokenizer import describe
    from models.hf.convert import import_hf

    src, run = Path(found["path"]), found["run_dir"]
    done = existing_export(run, src) if run is not None and found["to"] == "hf" and not out_dir else None
    if done is not None:  # e.g. the run's own hf/ of its final checkpoint: no second copy of the same weights
        return {"to": "hf", "source": str(src), "run_dir": str(run), "iteration": found["iteration"],
                "out_dir": str(done), "reused": True}
    if out_dir:
        out = Path(out_dir).expanduser().resolve()
    elif found["to"] == "hf" and run is not None and found["iteration"] is not None:
        out = Path(run) / "exports" / src.name
    else:
        out = src.with_name(f"{src.name}-{found['to']}")
    info = {"to": found["to"], "source": str(src), "run_dir": str(run) if run else None,
            "iteration": found["iteration"], "out_dir": str(out), "reused": False}
    if found["to"] == "megatron":
        import_hf(cfg, src, out, describe(src, cfg.tokenizer).to_dict())
        return info
    manifest = run_manifest(run) if run else prepare_data(cfg)  # the tokenizer it was trained with
    info["reused"] = export_checkpoint(cfg, manifest, src, out, found["iteration"])
    return info


def training_run_dir(run_dir: str | Path) -> Path:
    """`run_dir` resolved, checked to be a training run directory (EvaluationError saying what to pass)."""
    from models.evaluation.stages import EvaluationError

    path = Path(run_dir).expanduser().resolve()
    if not (path / "config.yaml").exists() or not (path / "data_manifest.json").exists():
        hint = ""
        if path.parent.name == "checkpoints" or path.name == "checkpoints":
            hint = f" (this is inside one: pass {path.parent.parent if path.parent.name == 'checkpoints' else path.parent})"
        raise EvaluationError(f"{run_dir}: not a training run directory (config.yaml, data_manifest.json, "
                              f"checkpoints/){hint}; pass <workdir>/runs/<run>, the run_dir `difflm run` and `difflm train` print")
    return path


def evaluated_scores(run_dir: Path) -> dict[int, dict]:
    """{iteration: score record} of the checkpoints evaluate-latest has scored in this run."""
    path = Path(run_dir) / EVAL_LATEST_DIR / "scores.json"
    return {int(k): v for k, v in json.loads(path.read_text()).items()} if path.exists() else {}


def remember_score(run_dir: Path, record: dict) -> None:
    scores = {**evaluated_scores(run_dir), int(record["iteration"]): record}
    path = Path(run_dir) / EVAL_LATEST_DIR / "scores.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")  # a scheduled run killed mid-write leaves the old file intact
    tmp.write_text(json.dumps({str(k): v for k, v in sorted(scores.items())}, indent=2))
    tmp.replace(path)


def export_newest(cfg: PipelineConfig, manifest: dict, run_dir: Path, attempts: int = 3) -> tuple[int, Path]:
    """(iteration, HF folder) of the run's newest complete checkpoint, exported to <run>/eval_latest/hf. Works
    while the trainer writes: an unfinished save is not named by checkpoints/latest, and a checkpoint pruned
    while being read is replaced by the newer one."""
    from models.megatron.checkpointing import iter_dir, latest_iteration

    out = Path(run_dir) / EVAL_LATEST_DIR / "hf"
    for _ in range(attempts):
        it = latest_iteration(Path(run_dir) / "checkpoints")
        if it is None:
            raise FileNotFoundError(f"{run_dir} has no complete checkpoint yet")
        ckpt = iter_dir(Path(run_dir) / "checkpoints", it)
        done = existing_export(run_dir, ckpt)
        if done is not None:  # the final checkpoint, already exported by the pipeline: score that folder
            return it, done
        try:
            export_checkpoint(cfg, manifest, ckpt, out, it)
            return it, out
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"{run_dir}: checkpoints were pruned faster than they could be read; run again")


def score_export_bound(cfg: PipelineConfig, manifest: dict, hf_dir: Path, max_sequences: int) -> dict:
    """The held-out likelihood bound (ELBO; exact NLL for ar) of an export on at most `max_sequences` windows:
    the cheap score of evaluate-latest (the same estimator as the full evaluation, a smaller budget)."""
    from models.evaluation.likelihood import likelihood_bound, validation_windows
    from models.evaluation.stages import check_tokenizer, eval_device, load_model, placement

    model = load_model(hf_dir, *eval_device(cfg.eval))
    check_tokenizer(model, manifest, hf_dir)
    windows = validation_windows(manifest, min(cfg.train.seq_length, model.config.max_position_embeddings),
                                 min(cfg.eval.max_sequences, max_sequences))
    return {**likelihood_bound(model, windows, cfg).to_dict(), **placement(model)}


def _experiment(cfg: PipelineConfig) -> str:
    """The id of the config's MLflow experiment, created as `difflm.tracking` creates it when missing."""
    import mlflow

    from difflm.tracking import tracking_uri

    exp = mlflow.get_experiment_by_name(cfg.tracking.experiment)
    if exp is not None:
        return exp.experiment_id
    local = tracking_uri(cfg).startswith("sqlite:///")  # artifacts beside the store, not in ./mlruns
    return mlflow.create_experiment(cfg.tracking.experiment, artifact_location=(
        (Path(cfg.workdir) / "mlartifacts").resolve().as_uri() if local else None))


def training_mlflow_run(cfg: PipelineConfig, run_dir: Path, manifest: dict) -> str | None:
    """The MLflow run of the pretrain-difflm execution that trains `run_dir`, if any: the first run tagged with
    it (pretrain-difflm tags `train.run_dir` once training returns) or, while it trains, the newest
    pretrain-difflm run on the same data whose resolved config names this run directory."""
    import mlflow
    import yaml
    from mlflow.tracking import MlflowClient

    from models.launch.torchrun import TRAIN_SECTIONS

    exp = mlflow.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        return None
    client, newest = MlflowClient(), ["attributes.start_time DESC"]
    # the parent (not its stage runs) of the FIRST execution that trained this run directory: the run its
    # registered version links to; later executions that found the stages cached only point at it
    tagged = client.search_runs([exp.experiment_id], f"tags.`train.run_dir` = '{run_dir}' and tags.flow = "
                                f"'pretrain-difflm'", max_results=1, order_by=["attributes.start_time ASC"])
    if tagged:
        return tagged[0].info.run_id
    for run in client.search_runs([exp.experiment_id], f"tags.flow = 'pretrain-difflm' and tags.`data.hash` = "
                                  f"'{manifest['hash']}'", max_results=20, order_by=newest):
        try:
            their = PipelineConfig.model_validate(yaml.safe_load(mlflow.artifacts.load_text(
                f"{run.info.artifact_uri}/config/resolved.yaml")))
        except Exception:  # no config artifact (tracking degraded then): not provably this run
            continue
        name = f"{their.diffusion.model_running_mode}-{manifest['hash']}-{their.stage_hash(*TRAIN_SECTIONS)}"
        if name == run_dir.name:
            return run.info.run_id
    return None


def log_latest_score(cfg: PipelineConfig, run_dir: Path, manifest: dict, iteration: int, score: dict) -> str | None:
    """Log the score at step = `iteration` into the training's MLflow run, else into a run of its own (one per
    run directory, reused by every scheduled call, tagged difflm.run_dir); returns that run's id. Tracking
    problems degrade (reported, not raised), as everywhere in the pipeline."""
    from difflm import tracking

    @tracking.tolerant
    def log() -> str:
        import mlflow
        from mlflow.tracking import MlflowClient

        mlflow.set_tracking_uri(tracking.tracking_uri(cfg))
        client = MlflowClient()
        run_id = training_mlflow_run(cfg, run_dir, manifest)
        if run_id is None:
            exp = _experiment(cfg)
            mine = client.search_runs([exp], f"tags.flow = 'evaluate-latest' and tags.`difflm.run_dir` = "
                                      f"'{run_dir}'", max_results=1)
            run_id = mine[0].info.run_id if mine else client.create_run(
                exp, run_name=f"evaluate-latest-{run_dir.name}",
                tags={"flow": "evaluate-latest", "difflm.run_dir": str(run_dir), "data.hash": manifest["hash"]},
            ).info.run_id
            client.set_terminated(run_id)  # each scheduled call adds points; the run is never left RUNNING
        for key in ("nll_per_token", "ppl", "bits_per_token"):
            client.log_metric(run_id, f"eval_latest.{key}", float(score[key]), step=int(iteration))
        return run_id

    return log() if cfg.tracking.enabled else None
