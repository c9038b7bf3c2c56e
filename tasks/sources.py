"""What a command on an existing SOURCE works on (a run directory, one of its checkpoints, an export, a stock HF
folder): which folder it is, the run it belongs to, and the config and data that run recorded.

A path enters once, here: `training_run_dir` and `conversion_source` turn what the user typed into a `RunDir`
(or None outside any run), and every later function takes that `RunDir`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from difflm import tracking
from difflm.config import PipelineConfig, load_config
from difflm.data_prep.pipeline import MANIFEST, prepare_data
from difflm.manifest import DataManifest
from difflm.models.evaluation.sources import resolve_export
from difflm.models.evaluation.stages import EvaluationError, default_out_dir
from difflm.models.hf.architectures import config_json
from difflm.models.hf.convert import ConversionError
from difflm.models.hf.importer import check_source
from difflm.rundir import RunDir, is_checkpoint, iteration_of

CONVERT_HINT = (
    "pass a run directory (<workdir>/runs/<run>: its newest complete checkpoint), a megatron checkpoint "
    "(<run>/checkpoints/iter_XXXXXXX, with metadata.json) or a Hugging Face export (config.json and "
    "model.safetensors, e.g. <run>/hf)"
)


@dataclass(frozen=True)
class ConversionSource:
    """What `difflm convert SOURCE` converts from: the folder to read, the direction, and the training run holding
    it (None outside any run) with the checkpoint's iteration (None for an export)."""

    to: Literal["hf", "megatron"]
    path: Path
    run: RunDir | None = None
    iteration: int | None = None
    stock: bool = False  # a transformers class's folder (Llama, Qwen2, ...), imported with the source's shape


def conversion_source(source: str | Path, to: str | None = None) -> ConversionSource:
    """What `source` converts from. A run directory means its newest complete checkpoint (`checkpoints/latest`,
    written only after a save finished). ConversionError otherwise, saying what to pass."""
    path = Path(source).expanduser().resolve()
    if path.is_file() and path.suffix == ".gguf":
        check_source(path)  # says how to make an HF folder of it
    if not path.is_dir():
        raise ConversionError(f"{source}: no such folder; {CONVERT_HINT}")
    holder = RunDir(path.parent)
    if holder.is_run() and holder.checkpoints == path:  # <run>/checkpoints: the run
        path = path.parent
    run = RunDir(path)
    if run.checkpoints.is_dir():
        it = run.latest_iteration()
        if it is None:
            raise ConversionError(
                f"{path} is a run directory without a complete checkpoint yet (no checkpoints/"
                f"latest): wait for the first save (checkpoint.save_interval), or pass a checkpoint"
            )
        found = ConversionSource("hf", run.checkpoint(it), run, it)
    elif is_checkpoint(path):
        found = ConversionSource("hf", path, RunDir.holding(path), iteration_of(path))
    elif is_stock_folder(path):  # Llama, Qwen2, Qwen3, Mistral...: difflm.models.hf.importer checks the rest
        found = ConversionSource("megatron", path, stock=True)
    elif (path / "config.json").exists() and (path / "model.safetensors").exists():
        found = ConversionSource("megatron", path, RunDir.holding(path))
    else:
        raise ConversionError(
            f"{source}: neither a run directory (checkpoints/), a megatron checkpoint "
            f"(metadata.json) nor a Hugging Face export (config.json + model.safetensors); "
            f"{CONVERT_HINT}"
        )
    if to and to != found.to:
        what = "a Hugging Face export" if found.to == "megatron" else "a megatron checkpoint (or a run)"
        raise ConversionError(
            f"{source} is {what}: it converts to {found.to}, not {to}; for {to}, pass "
            + ("a run directory or a megatron checkpoint" if to == "hf" else "an HF export")
        )
    return found


def is_stock_folder(path: Path) -> bool:
    """A Hugging Face model folder of a transformers class (not this project's export)."""
    config = Path(path) / "config.json"
    return config.exists() and config_json(path).get("model_type") != "difflm"


def training_run_dir(run_dir: str | Path) -> RunDir:
    """`run_dir` resolved, checked to be a training run directory (EvaluationError saying what to pass)."""
    run = RunDir(Path(run_dir).expanduser().resolve())
    if not run.has_inputs():
        holder = RunDir.holding(run.path)
        hint = f" (this is inside one: pass {holder.path})" if holder else ""
        raise EvaluationError(
            f"{run_dir}: not a training run directory (config.yaml, data_manifest.json, "
            f"checkpoints/){hint}; pass <workdir>/runs/<run>, the run_dir `difflm run` and `difflm train` print"
        )
    return run


def stage_config(run: RunDir | None, preset: str | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """The config of a stage on an existing run: `preset` + overrides when a preset is given; else the run's own
    config.yaml (architecture and tokenizer settings as trained; workdir = the folder holding runs/, so MLflow is
    the training's store) + overrides; with neither, tiny-cpu + overrides."""
    if preset or run is None or not run.config_file.exists():
        return load_config(preset or "tiny-cpu", overrides or [])
    return run.config(overrides)


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
