"""Plain functions of the stages that work on an existing training run, `convert-checkpoint` and
`evaluate-latest` (what `difflm convert` / `difflm eval-latest` call without Prefect; `tasks/stages.py` wraps them
as tasks): which folder a source is and where its conversion goes, a run's own config and data, the scores of
its checkpoints, and where in MLflow they belong."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from difflm import tracking
from difflm.config import PipelineConfig, load_config
from difflm.data_prep.pipeline import MANIFEST, prepare_data, unique_tokens
from difflm.data_prep.tokenizer import describe
from difflm.locks import exclusive
from difflm.manifest import DataManifest
from difflm.models.evaluation.likelihood import likelihood_bound, validation_windows
from difflm.models.evaluation.sources import resolve_export
from difflm.models.evaluation.stages import (
    EvaluationError,
    check_tokenizer,
    default_out_dir,
    eval_device,
    load_model,
    placement,
)
from difflm.models.hf.architectures import config_json
from difflm.models.hf.convert import ConversionError, export_hf, import_hf
from difflm.models.hf.importer import check_source, import_record, tokenizer_overrides
from difflm.rundir import (
    EVAL_LATEST,
    HF,
    RunDir,
    is_checkpoint,
    is_export_of,
    iteration_of,
    lock_file,
    run_name,
)
from difflm.tasks import adapt

CONVERT_HINT = (
    "pass a run directory (<workdir>/runs/<run>: its newest complete checkpoint), a megatron checkpoint "
    "(<run>/checkpoints/iter_XXXXXXX, with metadata.json) or a Hugging Face export (config.json and "
    "model.safetensors, e.g. <run>/hf)"
)
EVAL_LATEST_DIR = EVAL_LATEST  # <run>/eval_latest/: hf/ (the export being scored) and scores.json


def _run_of(folder: Path) -> Path | None:
    """The training run directory holding `folder` (a checkpoint, or an export of one), if any."""
    run = RunDir.holding(folder)
    return run.path if run else None


def conversion_source(source: str | Path, to: str | None = None) -> dict:
    """What `source` converts from: {'to': 'hf' | 'megatron', 'path': the folder to read, 'run_dir': the training
    run holding it (or None), 'iteration': the checkpoint's iteration (or None)}. A run directory means its newest
    complete checkpoint (`checkpoints/latest`, written only after a save finished). ConversionError otherwise."""
    path = Path(source).expanduser().resolve()
    if path.is_file() and path.suffix == ".gguf":
        check_source(path)  # says how to make an HF folder of it
    if not path.is_dir():
        raise ConversionError(f"{source}: no such folder; {CONVERT_HINT}")
    if RunDir(path.parent).is_run() and RunDir(path.parent).checkpoints == path:  # <run>/checkpoints: the run
        path = path.parent
    run = RunDir(path)
    if run.checkpoints.is_dir():
        it = run.latest_iteration()
        if it is None:
            raise ConversionError(
                f"{path} is a run directory without a complete checkpoint yet (no checkpoints/"
                f"latest): wait for the first save (checkpoint.save_interval), or pass a checkpoint"
            )
        found = {"to": "hf", "path": run.checkpoint(it), "run_dir": path, "iteration": it}
    elif is_checkpoint(path):
        found = {"to": "hf", "path": path, "run_dir": _run_of(path), "iteration": iteration_of(path)}
    elif is_stock_folder(path):  # Llama, Qwen2, Qwen3, Mistral...: difflm.models.hf.importer checks the rest
        found = {"to": "megatron", "path": path, "run_dir": None, "iteration": None, "stock": True}
    elif (path / "config.json").exists() and (path / "model.safetensors").exists():
        found = {"to": "megatron", "path": path, "run_dir": _run_of(path), "iteration": None}
    else:
        raise ConversionError(
            f"{source}: neither a run directory (checkpoints/), a megatron checkpoint "
            f"(metadata.json) nor a Hugging Face export (config.json + model.safetensors); "
            f"{CONVERT_HINT}"
        )
    if to and to != found["to"]:
        what = "a Hugging Face export" if found["to"] == "megatron" else "a megatron checkpoint (or a run)"
        raise ConversionError(
            f"{source} is {what}: it converts to {found['to']}, not {to}; for {to}, pass "
            + ("a run directory or a megatron checkpoint" if to == "hf" else "an HF export")
        )
    return found


def is_stock_folder(path: Path) -> bool:
    """A Hugging Face model folder of a transformers class (not this project's export)."""
    config = Path(path) / "config.json"
    return config.exists() and config_json(path).get("model_type") != "difflm"


def stage_config(run_dir: Path | None, preset: str | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """The config of a stage on an existing run: `preset` + overrides when a preset is given; else the run's own
    config.yaml (architecture and tokenizer settings as trained; workdir = the folder holding runs/, so MLflow is
    the training's store) + overrides; with neither, tiny-cpu + overrides."""
    if preset or run_dir is None or not RunDir(run_dir).config_file.exists():
        return load_config(preset or "tiny-cpu", overrides or [])
    return RunDir(run_dir).config(overrides)


def run_manifest(run_dir: Path) -> DataManifest:
    """The data manifest a run was trained on (its tokenizer, held-out split, hash)."""
    return RunDir(run_dir).manifest()


# ---- what a command on a SOURCE (a run, one of its checkpoints, an export) evaluates on ------------------------
# The source's recorded config and data, unless the user says otherwise: with --preset, the preset (explicit);
# data.* / tokenizer.* overrides on top of the run's config are other data, read through the model's own tokenizer;
# results on other data go to <run>/eval-<data hash>/ (default_out_dir), never over the run's own <run>/eval/.


def _data_hash(cfg: PipelineConfig) -> str:
    return cfg.stage_hash("data", "tokenizer")


def source_config(
    source: str | Path, preset: str | None = None, overrides: list[str] | None = None
) -> tuple[PipelineConfig, RunDir | None]:
    """(config, run) of a command on `source`, the run being the one it belongs to (None outside any run).
    `preset` given: preset + overrides. Else the config the run recorded + overrides; when these change its data
    and name no tokenizer.* field, tokenizer.path is the model's own tokenizer (the export's folder), so the other
    data is tokenized as the model was trained. A source outside any run: tiny-cpu + overrides."""
    run = RunDir.holding(source)
    if preset or run is None or not run.has_inputs():
        return load_config(preset or "tiny-cpu", overrides or []), run
    cfg = run.config(overrides)
    names_tokenizer = any(o.split("=", 1)[0].strip().startswith("tokenizer.") for o in overrides or [])
    if not names_tokenizer and is_other_data(cfg, run):
        tokenizer = Path(source) if (Path(source) / "tokenizer.json").exists() else Path(run.manifest().tokenizer.path)
        cfg = run.config([*(overrides or []), f"tokenizer.path={tokenizer.resolve()}"])
    return cfg, run


def is_other_data(cfg: PipelineConfig, run: RunDir | None) -> bool:
    """Whether `cfg` names other data (or another tokenizer) than the run was trained on."""
    if run is None or not run.has_inputs():
        return False
    return _data_hash(cfg) not in (run.data_hash(), _data_hash(run.config()))


def recorded_data(cfg: PipelineConfig, run: RunDir | None) -> DataManifest | None:
    """The run's own data manifest when `cfg` evaluates on the run's data and that data is still on disk; None
    otherwise (prepare cfg's data: other data, or the run's again when its folder was removed)."""
    if run is None or not run.has_inputs() or is_other_data(cfg, run):
        return None
    manifest = run.manifest()
    return manifest if (Path(manifest.dir) / MANIFEST).exists() else None


def evaluation_source(
    source: str,
    preset: str | None = None,
    overrides: list[str] | None = None,
    tracking_uri: str | None = None,
    out_dir: str | Path | None = None,
) -> dict:
    """What `difflm eval SOURCE` evaluates: {'config', 'hf_dir', 'run_dir' (or None), 'manifest', 'out_dir',
    'other_data'}; data is prepared when it is not the run's recorded one (see `source_config`)."""
    named = load_config(preset or "tiny-cpu", overrides or []) if source.startswith("models:/") else None
    if named is not None and not tracking_uri:  # the store of the config the user named
        tracking_uri = tracking.tracking_uri(named)
    hf_dir = resolve_export(source, tracking_uri, named.tracking if named is not None else None)
    cfg, run = source_config(hf_dir, preset, overrides)
    manifest = recorded_data(cfg, run) or prepare_data(cfg)
    out = Path(out_dir) if out_dir else default_out_dir(cfg, source, hf_dir, manifest.hash)
    return {
        "config": cfg,
        "hf_dir": hf_dir,
        "run_dir": run.path if run else None,
        "manifest": manifest,
        "out_dir": out,
        "other_data": is_other_data(cfg, run),
    }


def export_checkpoint(
    cfg: PipelineConfig, manifest: DataManifest, ckpt: Path, out: Path, iteration: int | None
) -> bool:
    """Export `ckpt` to `out` unless `out` already holds its export; True when reused. A checkpoint pruned by the
    trainer while being read (checkpoint.keep_last) gives FileNotFoundError, so callers can take the newer one.
    One writer per folder: a second export to `out` waits for the first, then reuses it (`pipeline.on_busy`)."""
    with exclusive(lock_file(out), f"export {out}", cfg.pipeline.on_busy):
        if is_export_of(out, ckpt):
            return True
        _export(cfg, manifest, ckpt, out, iteration)
    return False


def _export(cfg: PipelineConfig, manifest: DataManifest, ckpt: Path, out: Path, iteration: int | None) -> None:
    provenance = {"data_hash": manifest.hash, "mode": cfg.diffusion.model_running_mode, "iteration": iteration}
    try:
        export_hf(cfg, manifest.tokenizer.to_dict(), ckpt, out, provenance)
    except Exception as err:
        if not ckpt.exists():
            raise FileNotFoundError(
                f"{ckpt} was removed while being read (the trainer keeps only "
                f"checkpoint.keep_last checkpoints): run again for the newer one"
            ) from err
        if isinstance(err, RuntimeError) and "size mismatch" in str(err):
            raise ConversionError(
                f"{ckpt} does not fit the model of this config ({cfg.name}: hidden "
                f"{cfg.model.hidden_size}, {cfg.model.num_layers} layers): pass the preset and "
                f"overrides it was trained with"
            ) from err
        raise


def existing_export(run_dir: str | Path, ckpt: str | Path) -> Path | None:
    """An HF folder of the run already exported from `ckpt` (the pipeline's hf/, an earlier conversion, the
    folder evaluate-latest scores), if any."""
    return RunDir(run_dir).export_of(ckpt)


def convert_source(cfg: PipelineConfig, found: dict, out_dir: str | Path | None = None) -> dict:
    """Convert what `conversion_source` found; the output goes to `out_dir`, else <run>/exports/iter_XXXXXXX for a
    run's checkpoint, else next to the source (<name>-hf, <name>-megatron). Returns where and what."""
    src, run = Path(found["path"]), found["run_dir"]
    done = existing_export(run, src) if run is not None and found["to"] == "hf" and not out_dir else None
    if done is not None:  # e.g. the run's own hf/ of its final checkpoint: no second copy of the same weights
        return {
            "to": "hf",
            "source": str(src),
            "run_dir": str(run),
            "iteration": found["iteration"],
            "out_dir": str(done),
            "reused": True,
        }
    if out_dir:
        out = Path(out_dir).expanduser().resolve()
    elif found["to"] == "hf" and run is not None and found["iteration"] is not None:
        out = RunDir(run).export_dir(src)
    else:
        out = src.with_name(f"{src.name}-{found['to']}")
    info = {
        "to": found["to"],
        "source": str(src),
        "run_dir": str(run) if run else None,
        "iteration": found["iteration"],
        "out_dir": str(out),
        "reused": False,
    }
    if found.get("stock"):  # the model fields follow the source, parallel.* sets the vocabulary padding
        imported = adapt.import_source(adapt.with_source(cfg, src), src, out)
        # what trains from it, printed for the user: `difflm train` takes these overrides
        info["use"] = [f"train.init_from={out}", *tokenizer_overrides(imported.tokenizer), *adapt.source_overrides(src)]
        info["parity"] = (import_record(out) or {}).get("parity")  # the logit check the import passed
        return info
    if found["to"] == "megatron":
        with exclusive(lock_file(out), f"conversion output {out}", cfg.pipeline.on_busy):
            import_hf(cfg, src, out, describe(src, cfg.tokenizer).to_dict())
        return info
    manifest = run_manifest(run) if run else prepare_data(cfg)  # the tokenizer it was trained with
    info["reused"] = export_checkpoint(cfg, manifest, src, out, found["iteration"])
    return info


def training_run_dir(run_dir: str | Path) -> Path:
    """`run_dir` resolved, checked to be a training run directory (EvaluationError saying what to pass)."""
    path = Path(run_dir).expanduser().resolve()
    if not RunDir(path).has_inputs():
        run = RunDir.holding(path)
        hint = f" (this is inside one: pass {run.path})" if run else ""
        raise EvaluationError(
            f"{run_dir}: not a training run directory (config.yaml, data_manifest.json, "
            f"checkpoints/){hint}; pass <workdir>/runs/<run>, the run_dir `difflm run` and `difflm train` print"
        )
    return path


def evaluated_scores(run_dir: Path) -> dict[int, dict]:
    """{iteration: score record} of the checkpoints evaluate-latest has scored in this run."""
    path = RunDir(run_dir).scores
    return {int(k): v for k, v in json.loads(path.read_text()).items()} if path.exists() else {}


def remember_score(run_dir: Path, record: dict) -> None:
    scores = {**evaluated_scores(run_dir), int(record["iteration"]): record}
    path = RunDir(run_dir).scores
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")  # a scheduled run killed mid-write leaves the old file intact
    tmp.write_text(json.dumps({str(k): v for k, v in sorted(scores.items())}, indent=2))
    tmp.replace(path)


def export_newest(cfg: PipelineConfig, manifest: DataManifest, run_dir: Path, attempts: int = 3) -> tuple[int, Path]:
    """(iteration, HF folder) of the run's newest complete checkpoint, exported to <run>/eval_latest/hf. Works
    while the trainer writes: an unfinished save is not named by checkpoints/latest, and a checkpoint pruned
    while being read is replaced by the newer one."""
    run = RunDir(run_dir)
    out = run.eval_latest / HF
    for _ in range(attempts):
        it = run.latest_iteration()
        if it is None:
            raise FileNotFoundError(f"{run_dir} has no complete checkpoint yet")
        ckpt = run.checkpoint(it)
        done = existing_export(run_dir, ckpt)
        if done is not None:  # the final checkpoint, already exported by the pipeline: score that folder
            return it, done
        try:
            export_checkpoint(cfg, manifest, ckpt, out, it)
            return it, out
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"{run_dir}: checkpoints were pruned faster than they could be read; run again")


def score_export_bound(cfg: PipelineConfig, manifest: DataManifest, hf_dir: Path, max_sequences: int) -> dict:
    """The held-out likelihood bound (ELBO; exact NLL for ar) of an export on at most `max_sequences` windows:
    the cheap score of evaluate-latest (the same estimator as the full evaluation, a smaller budget)."""
    model = load_model(hf_dir, *eval_device(cfg.eval))
    check_tokenizer(model, manifest, hf_dir)
    windows = validation_windows(
        manifest,
        min(cfg.train.seq_length, model.config.max_position_embeddings),
        min(cfg.eval.max_sequences, max_sequences),
    )
    return {**likelihood_bound(model, windows, cfg).to_dict(), **placement(model)}


def training_mlflow_run(cfg: PipelineConfig, run_dir: Path, manifest: DataManifest) -> str | None:
    """The MLflow run of the pretrain-difflm execution that trains `run_dir`, if any: the first run tagged with
    it (pretrain-difflm tags `train.run_dir` once training returns) or, while it trains, the newest
    pretrain-difflm run on the same data whose resolved config names this run directory."""
    import mlflow  # imported when tracking is on: runs with tracking.enabled=false never load it
    from mlflow.tracking import MlflowClient

    exp = mlflow.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        return None
    client, newest = MlflowClient(), ["attributes.start_time DESC"]
    # the parent (not its stage runs) of the FIRST execution that trained this run directory: the run its
    # registered version links to; later executions that found the stages cached only point at it
    tagged = client.search_runs(
        [exp.experiment_id],
        f"tags.`train.run_dir` = '{run_dir}' and tags.flow = 'pretrain-difflm'",
        max_results=1,
        order_by=["attributes.start_time ASC"],
    )
    if tagged:
        return tagged[0].info.run_id
    for run in client.search_runs(
        [exp.experiment_id],
        f"tags.flow = 'pretrain-difflm' and tags.`data.hash` = '{manifest.hash}'",
        max_results=20,
        order_by=newest,
    ):
        try:
            their = PipelineConfig.model_validate(
                yaml.safe_load(mlflow.artifacts.load_text(f"{run.info.artifact_uri}/config/resolved.yaml"))
            ).with_unique_tokens(unique_tokens(manifest))  # logged before a length in epochs had its steps
        except Exception:  # no config artifact (tracking degraded then): not provably this run
            continue
        if run_name(their, manifest.hash) == run_dir.name:
            return run.info.run_id
    return None


def log_latest_score(
    cfg: PipelineConfig, run_dir: Path, manifest: DataManifest, iteration: int, score: dict
) -> str | None:
    """Log the score at step = `iteration` into the training's MLflow run, else into a run of its own (one per
    run directory, reused by every scheduled call, tagged difflm.run_dir); returns that run's id. Tracking
    problems degrade (reported, not raised), as everywhere in the pipeline."""

    @tracking.tolerant
    def log() -> str:
        from mlflow.tracking import MlflowClient  # as above: only with tracking on

        tracking.use_store(tracking.tracking_uri(cfg))
        client = MlflowClient()
        run_id = training_mlflow_run(cfg, run_dir, manifest)
        if run_id is None:
            exp = tracking.experiment_id(cfg)
            mine = client.search_runs(
                [exp], f"tags.flow = 'evaluate-latest' and tags.`difflm.run_dir` = '{run_dir}'", max_results=1
            )
            run_id = (
                mine[0].info.run_id
                if mine
                else client.create_run(
                    exp,
                    run_name=f"evaluate-latest-{run_dir.name}",
                    tags={"flow": "evaluate-latest", "difflm.run_dir": str(run_dir), "data.hash": manifest.hash},
                ).info.run_id
            )
            client.set_terminated(run_id)  # each scheduled call adds points; the run is never left RUNNING
        for key in ("nll_per_token", "ppl", "bits_per_token"):
            client.log_metric(run_id, f"eval_latest.{key}", float(score[key]), step=int(iteration))
        return run_id

    return log() if cfg.tracking.enabled else None
