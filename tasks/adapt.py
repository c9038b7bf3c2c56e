"""AR-to-diffusion adaptation: the source checkpoint (an HF folder), its lineage, its import and its AR baseline.

Plain functions, used by the flows (`adapt-difflm`, and `pretrain-difflm` with an HF folder as `train.init_from_hf`)
and testable without Prefect:

- `resolve_source`: an HF folder, or `smollm2` for the offline example (models/hf/pretrained.py);
- `source_lineage`: path, sha256 of the config and weight files, architecture: the run's lineage in MLflow;
- `source_fields` / `with_source`: the config fields the source fixes (architecture; tokenizer for this project's
  exports);
- `import_source`: the one import entry point, the source's weights as a megatron checkpoint (stock classes
  through `difflm.models.hf.importer`, with the tokenizer and its mask token prepared beside them; this project's exports
  through `import_hf`), returned as a typed `ImportedSource`;
- `with_import`: the config that trains from that checkpoint and reads data through that tokenizer;
- `export_source_ar`: the checkpoint exported as an `ar` model of this project's class, so the original AR model
  is evaluated by the same code on the same tokens and task items as the adapted one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pydantic.dataclasses import dataclass
from tokenizers import Tokenizer

from difflm.config import PipelineConfig, is_hf_folder, load_config, with_mode
from difflm.data_prep.tokenizer import describe
from difflm.errors import UserError
from difflm.locks import exclusive
from difflm.manifest import TokenizerInfo
from difflm.models.diffusion.arch import ModelArch
from difflm.models.evaluation.record import EvalRecord
from difflm.models.hf.architectures import config_json, model_fields
from difflm.models.hf.convert import export_hf, import_hf
from difflm.models.hf.examples import EXAMPLE_SOURCES
from difflm.models.hf.export import Export
from difflm.models.hf.importer import check_source, import_pretrained, import_record, weight_files
from difflm.models.hf.pretrained import smollm2_folder
from difflm.rundir import is_checkpoint, is_export_of, lock_file

__all__ = ["is_hf_folder"]  # where the flows read it


def resolve_source(source: str) -> Path:
    """The HF folder of `source`: a local folder, or the name of an offline example (EXAMPLE_SOURCES). What is
    not a folder with config.json is refused with the importer's line (a GGUF file, a missing folder)."""
    if source in EXAMPLE_SOURCES:
        return smollm2_folder()
    folder = Path(source).expanduser().resolve()
    if not (folder / "config.json").exists():
        check_source(folder)  # raises, saying what to pass
    return folder


def adaptation_config(source: str, preset: str, overrides: list[str] | None) -> tuple[PipelineConfig, Path]:
    """The preset, the fields the source fixes (architecture, tokenizer, `train.init_from_hf`), then the user's
    overrides; and the source's folder. The flow adapt-difflm's config, also checked before its server starts."""
    folder = resolve_source(source)
    fixed = [*source_overrides(folder), f"train.init_from_hf={folder}"]
    return load_config(preset, [*fixed, *(overrides or [])]), folder


def _config(folder: Path) -> dict:
    return config_json(folder)


def _is_ours(folder: Path) -> bool:
    return _config(folder).get("model_type") == "difflm"


def source_lineage(folder: Path) -> dict[str, str]:
    """{path, sha256, architecture, model_type} of the source: sha256 over its config and weight files, by name."""
    h = hashlib.sha256()
    for f in [folder / "config.json", *weight_files(folder)]:
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    config = _config(folder)
    return {
        "path": str(folder),
        "sha256": h.hexdigest(),
        "architecture": (config.get("architectures") or ["?"])[0],
        "model_type": config.get("model_type", "?"),
    }


def source_fields(folder: Path) -> dict[str, dict[str, Any]]:
    """{section: {field: value}} the source fixes: its architecture (`difflm.models.hf.architectures.model_fields` for
    stock classes), and for this project's exports their tokenizer and its special tokens (a stock source's
    tokenizer is prepared by the import, `with_import`)."""
    if not _is_ours(folder):
        return {"model": model_fields(*check_source(folder))}
    c = _config(folder)
    model = {
        "num_layers": c["num_hidden_layers"],
        "hidden_size": c["hidden_size"],
        "num_attention_heads": c["num_attention_heads"],
        "num_query_groups": c.get("num_key_value_heads") or c["num_attention_heads"],
        "ffn_hidden_size": c["intermediate_size"],
        **ModelArch.from_hf_config(c).model_fields(),  # the export's architecture record (or its old flat fields)
        "norm_epsilon": c.get("norm_eps", 1e-5),
        "rotary_base": int(c.get("rope_theta", 10000)),
        "tie_embeddings": c.get("tie_word_embeddings", True),
    }
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer: dict[str, Any] = {"path": str(folder)}
    for role, key in (("mask_token", "mask_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "pad_token_id")):
        if c.get(key) is not None:
            tokenizer[role] = tok.id_to_token(int(c[key]))
    return {"model": model, "tokenizer": tokenizer}


def source_overrides(folder: Path) -> list[str]:
    """`source_fields` as `section.field=value` overrides, for a preset the user's own overrides then refine."""
    return [f"{section}.{k}={_text(v)}" for section, fields in source_fields(folder).items() for k, v in fields.items()]


def _text(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def with_source(cfg: PipelineConfig, folder: Path | None = None) -> PipelineConfig:
    """`cfg` with the fields the HF folder `folder` (default: `train.init_from_hf`) fixes set over its own."""
    folder = folder or source_folder(cfg)
    data = cfg.model_dump(mode="json")
    for section, fields in source_fields(folder).items():
        data[section] = {**data[section], **fields}
    return PipelineConfig.model_validate(data)


def source_folder(cfg: PipelineConfig) -> Path:
    """The HF folder the config starts from (`train.init_from_hf`), resolved."""
    if not cfg.train.init_from_hf:
        raise UserError(
            "this config adapts no HF model: set train.init_from_hf=<HF folder> (or run `difflm adapt SOURCE`)"
        )
    return Path(cfg.train.init_from_hf).expanduser().resolve()


@dataclass(frozen=True)
class ImportedSource:
    """A source imported once: the megatron checkpoint of its weights, the tokenizer the import prepared (a stock
    source's `{'path', 'tokens'}`; None for this project's export, whose tokenizer is its own folder's), and its
    lineage (`source_lineage`). A pydantic dataclass: Prefect stores it as JSON (the import stage's cache)."""

    checkpoint: Path
    tokenizer: dict | None
    lineage: dict

    @classmethod
    def read(cls, value: ImportedSource | str, lineage: dict | None = None) -> ImportedSource:
        """The value itself, or one a Prefect result store holds from before it was typed (the checkpoint)."""
        return value if isinstance(value, ImportedSource) else cls.of(Path(value), lineage or {})

    @classmethod
    def of(cls, checkpoint: Path, lineage: dict) -> ImportedSource:
        record = import_record(checkpoint)
        return cls(Path(checkpoint), record["tokenizer"] if record else None, lineage)


def import_source(cfg: PipelineConfig, folder: Path, out_dir: Path, lineage: dict | None = None) -> ImportedSource:
    """The one import entry point: a megatron checkpoint of the source's weights (model only: `train.init_from`
    starts a fresh optimizer), with logit parity checked by the importer; reused when `out_dir` holds one.
    `cfg.model` must describe the source (`with_source`). A stock source's tokenizer, with
    `tokenizer.mask_token` reused or added, is written into `<out_dir>/tokenizer`. A second import into `out_dir`
    waits for the first, then reuses it (`pipeline.on_busy`)."""
    with exclusive(lock_file(out_dir), f"import {out_dir}", cfg.pipeline.on_busy):
        if not is_checkpoint(out_dir):
            if _is_ours(folder):
                import_hf(cfg, folder, out_dir, describe(folder, cfg.tokenizer).to_dict())
            else:
                import_pretrained(cfg, folder, out_dir)
    return ImportedSource.of(out_dir, lineage or source_lineage(folder))


def with_import(cfg: PipelineConfig, imported: ImportedSource) -> PipelineConfig:
    """`cfg` training from the imported checkpoint (`train.init_from`; `init_from_hf` done with, so the run is
    named as it always was), its data read through the tokenizer the import prepared (stock sources): that
    tokenizer's path and mask token; the EOS and pad tokens the config names when the tokenizer has them (the
    defaults `<|endoftext|>` is SmolLM2's and Qwen's document separator), else the source's own."""
    train = cfg.train.model_copy(update={"init_from": str(imported.checkpoint), "init_from_hf": None})
    tok = imported.tokenizer
    if tok is None:  # this project's export: its tokenizer is the source folder's (source_fields)
        return cfg.model_copy(update={"train": train})
    vocab = Tokenizer.from_file(str(Path(tok["path"]) / "tokenizer.json"))
    fields = {"path": tok["path"], "mask_token": tok["tokens"]["mask_token"]}
    for role in ("eos_token", "pad_token"):
        ours = getattr(cfg.tokenizer, role)
        fields[role] = ours if vocab.token_to_id(ours) is not None else tok["tokens"][role]
    return cfg.model_copy(update={"train": train, "tokenizer": cfg.tokenizer.model_copy(update=fields)})


def ar_config(cfg: PipelineConfig) -> PipelineConfig:
    """`cfg` as the source's autoregressive model: mode ar, no adaptation options (same data, model, eval)."""
    return with_mode(cfg, "ar", attention_anneal_steps=0)


def export_source_ar(cfg: PipelineConfig, tokenizer: TokenizerInfo, ckpt: Path, out_dir: Path, lineage: dict) -> Export:
    """The imported checkpoint as an `ar` export of this project's class (its evaluator's input), with the data
    manifest's tokenizer; reused."""
    if is_export_of(out_dir, str(ckpt)):
        return Export.read(out_dir)
    tok = tokenizer.to_dict()  # the export's tokenizer fields (the HF room reads them as a dict)
    record = import_record(ckpt)  # a mask token the import added stays out of ar's normaliser (the source's NLL)
    if record and record["tokenizer"]["mask_id"] == tokenizer.mask_id:
        tok["mask_added"] = bool(record["tokenizer"].get("mask_row_added"))
    return export_hf(ar_config(cfg), tok, ckpt, out_dir, {"mode": "ar", "source": lineage})


def comparison_markdown(lineage: dict, adapted: EvalRecord, source: EvalRecord) -> str:
    """The adapted model next to its source AR model on the same held-out tokens and task items."""
    tasks = sorted(adapted.tasks)
    rows = [
        "| model | mode | bound | nats/token | ppl | " + " | ".join(tasks) + " |",
        "|---|---|---|---|---|" + "---|" * len(tasks),
    ]
    for name, res in (("adapted", adapted), ("source AR", source)):
        b = res.trained
        cells = []
        for t in tasks:
            scores = res.tasks.get(t, {})
            main = next((scores[k] for k in ("acc", "bits_per_byte") if scores.get(k) is not None), None)
            cells.append("n/a" if main is None else f"{main:.3f}")
        rows.append(
            f"| {name} | {res.mode} | {b['kind']} | {b['nll_per_token']:.4f} | {b['ppl']:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    head = (
        f"Source: `{lineage['path']}` ({lineage['architecture']}, sha256 {lineage['sha256'][:16]}...). "
        "Both rows score the same held-out windows and task items; the adapted model's figure is an upper bound "
        "(ELBO), the AR model's an exact NLL.\n\n"
    )
    return head + "\n".join(rows) + "\n"
