"""Converting what `tasks/sources.py` found: a megatron checkpoint to a Hugging Face export (once per output folder,
reused when it already holds that checkpoint's export in that format: this project's, or an engine's layout,
`difflm.models.hf.engines`), an export back to a megatron checkpoint, a stock HF folder imported. `difflm convert`
calls `convert_source` without Prefect; `tasks/stages.py` wraps it as a task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from difflm.config import PipelineConfig
from difflm.data_prep.pipeline import prepare_data
from difflm.data_prep.tokenizer import describe
from difflm.locks import exclusive
from difflm.manifest import DataManifest
from difflm.models.hf.convert import ConversionError, check_replaceable, export_hf, import_hf
from difflm.models.hf.engines import ENGINE_FORMATS, export_engine
from difflm.models.hf.export import Export
from difflm.models.hf.importer import import_record, tokenizer_overrides
from difflm.rundir import is_export_of, lock_file
from difflm.tasks import adapt
from difflm.tasks.sources import ConversionSource

FORMATS = ("difflm", *ENGINE_FORMATS)  # `difflm convert --format`: this project's layout, or an engine's


def export_checkpoint(
    cfg: PipelineConfig, manifest: DataManifest, ckpt: Path, out: Path, iteration: int | None, fmt: str = "difflm"
) -> bool:
    """Export `ckpt` to `out` in `fmt` unless `out` already holds that export; True when reused. A checkpoint pruned
    by the trainer while being read (checkpoint.keep_last) gives FileNotFoundError, so callers can take the newer
    one. One writer per folder: a second export to `out` waits for the first, then reuses it (`pipeline.on_busy`)."""
    with exclusive(lock_file(out), f"export {out}", cfg.pipeline.on_busy):
        if is_export_of(out, ckpt) and Export.read(out).format == fmt:
            return True
        _export(cfg, manifest, ckpt, out, iteration, fmt)
    return False


def _export(
    cfg: PipelineConfig, manifest: DataManifest, ckpt: Path, out: Path, iteration: int | None, fmt: str
) -> None:
    provenance = {"data_hash": manifest.hash, "mode": cfg.diffusion.model_running_mode, "iteration": iteration}
    try:
        if fmt == "difflm":
            export_hf(cfg, manifest.tokenizer.to_dict(), ckpt, out, provenance)
        else:
            export_engine(cfg, manifest.tokenizer.to_dict(), ckpt, out, fmt, provenance)
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


def convert_source(
    cfg: PipelineConfig, found: ConversionSource, out_dir: str | Path | None = None, fmt: str = "difflm"
) -> dict:
    """Convert what `conversion_source` found; the output goes to `out_dir`, else <run>/exports/iter_XXXXXXX for a
    run's checkpoint (iter_XXXXXXX-<fmt> for an engine's layout), else next to the source (<name>-hf,
    <name>-<fmt>, <name>-megatron). `fmt`: the export's layout (FORMATS), for a checkpoint only. Returns where and
    what."""
    src, run = found.path, found.run
    if fmt not in FORMATS:
        raise ConversionError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt != "difflm" and found.to != "hf":
        raise ConversionError(
            f"--format {fmt} writes a checkpoint's export; {src} converts to megatron: pass a run directory or a "
            f"megatron checkpoint"
        )
    info: dict[str, Any] = {
        "to": found.to,
        "format": fmt,
        "source": str(src),
        "run_dir": str(run.path) if run else None,
        "iteration": found.iteration,
    }
    # e.g. the run's own hf/ of its final checkpoint: no second copy of the same weights
    done = run.export_of(src) if run is not None and found.to == "hf" and not out_dir and fmt == "difflm" else None
    if done is not None:
        return {**info, "out_dir": str(done), "reused": True}
    suffix = "" if fmt == "difflm" else f"-{fmt}"
    if out_dir:
        out = Path(out_dir).expanduser().resolve()
    elif found.to == "hf" and run is not None and found.iteration is not None:
        out = run.export_dir(src).with_name(run.export_dir(src).name + suffix)
    else:
        out = src.with_name(f"{src.name}-{fmt if suffix else found.to}")
    info = {**info, "out_dir": str(out), "reused": False}
    # before any lock or write: a folder difflm did not write (someone's megatron checkpoint, a folder of files) is
    # neither taken for an earlier output nor replaced, and gets no lock file beside it in the user's folder
    check_replaceable(out, found.to)
    if found.stock:  # the model fields follow the source, parallel.* sets the vocabulary padding
        imported = adapt.import_source(adapt.with_source(cfg, src), src, out)
        # what trains from it, printed for the user: `difflm train` takes these overrides
        tokens = tokenizer_overrides(imported.tokenizer) if imported.tokenizer else []  # a stock import prepares one
        info["use"] = [f"train.init_from={out}", *tokens, *adapt.source_overrides(src)]
        info["parity"] = (import_record(out) or {}).get("parity")  # the logit check the import passed
        return info
    if found.to == "megatron":
        with exclusive(lock_file(out), f"conversion output {out}", cfg.pipeline.on_busy):
            import_hf(cfg, src, out, describe(src, cfg.tokenizer).to_dict())
        return info
    manifest = run.manifest() if run else prepare_data(cfg)  # the tokenizer it was trained with
    info["reused"] = export_checkpoint(cfg, manifest, src, out, found.iteration, fmt)
    if fmt != "difflm":  # the logit check it passed (and, for gguf, the file read back)
        info["export"] = Export.read(out).to_marker()
    return info
