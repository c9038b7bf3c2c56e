"""Stock transformers checkpoints (Llama, Qwen2, Qwen3, Mistral, Gemma) into megatron-core, and `ar` models back out.

    import_pretrained(cfg, folder, out_dir, tokenizer=None) -> out_dir   # a megatron dist checkpoint
    export_stock(cfg, tokenizer, ckpt_dir, out_dir) -> Export           # a folder AutoModelForCausalLM loads

Both directions run the two models on the same tokens and raise ConversionError when their logits differ by
more than PARITY_TOLERANCE (relative: max |a - b| / max |a|, fp32 on the CPU), so nothing is written from a
mapping that does not compute the source's function. The megatron checkpoint holds full tensors (megatron's
sharded state dict cuts QKV per query group and [gate; up] per half on load), so it loads at any TP/PP; only the
vocabulary padding depends on TP (`padded_vocab_size`), and it is the config's.

The tokenizer comes along with a mask token: the configured `tokenizer.mask_token` is reused when the tokenizer
has it (a reserved token, as the recipes do), else added as a new id whose embedding row starts at the mean of
the others. The choice is written to `<out>/difflm_import.json` and into the tokenizer copy (`<out>/tokenizer`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from difflm import outputs
from difflm.config import PipelineConfig, with_mode
from difflm.models.diffusion.modes import build_objective
from difflm.models.hf.architectures import (
    Shape,
    architecture_of,
    check_exportable,
    model_fields,
    ours_to_stock,
    read_config,
    stock_config,
    stock_to_ours,
)
from difflm.models.hf.convert import (
    ConversionError,
    _local_key,
    check_inside,
    check_replaceable,
    load_megatron_weights,
    repad_vocab,
    save_export,
    to_hf_state_dict,
)
from difflm.models.hf.export import Export

# megatron (difflm.models.megatron, megatron.core) is imported inside the functions that run it, as in difflm.models.hf.convert:
# the source checks and the tokenizer preparation load without it
PARITY_TOLERANCE = 1e-4  # relative max logit difference, fp32 on the CPU
IMPORT_RECORD = "difflm_import.json"
TOKENIZER_DIR = "tokenizer"


# ---- reading a stock folder --------------------------------------------------------------------------------------
def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of `folder` (one file, or the shards its index names); ConversionError otherwise."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    check_inside(folder)
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        check_inside(folder, names)
        missing = [n for n in names if not (folder / n).exists()]
        if missing:
            raise ConversionError(
                f"{index} names {len(missing)} missing shard(s) ({', '.join(missing[:3])}): copy the whole folder"
            )
        return [folder / n for n in names]
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    if any(folder.glob("*.bin")):
        raise ConversionError(
            f"{folder}: PyTorch .bin weights only; save them as safetensors first "
            f"(AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir))"
        )
    raise ConversionError(f"{folder}: no weights (model.safetensors or model.safetensors.index.json)")


def check_source(folder: str | Path):
    """(architecture, config.json) of a stock HF folder, its weights and tokenizer present: every refusal of
    `import_pretrained` that needs no model, before anything is written."""
    folder = Path(folder).expanduser()
    if folder.is_file() and folder.suffix == ".gguf":
        raise ConversionError(
            f"{folder} is a GGUF file, not an HF folder: dequantize it into one first (transformers: "
            f"AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) then save_pretrained)"
        )
    if not folder.is_dir():
        raise ConversionError(f"{folder}: no such folder; pass a Hugging Face model folder")
    check_inside(folder)  # config, tokenizer and weights: before reading any of them
    arch, c = read_config(folder)
    weight_files(folder)
    if not (folder / "tokenizer.json").exists():
        raise ConversionError(
            f"{folder}: no tokenizer.json; save the model's (fast) tokenizer into the folder "
            f"(AutoTokenizer.from_pretrained(...).save_pretrained(dir))"
        )
    return arch, c


def source_overrides(folder: str | Path) -> list[str]:
    """`model.*=value` overrides that make this project's model compute the stock model of `folder`."""
    arch, c = check_source(folder)
    out = []
    for k, v in model_fields(arch, c).items():
        out.append(f"model.{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}")
    return out


def load_stock_weights(folder: Path) -> dict[str, torch.Tensor]:
    sd = {}
    for f in weight_files(folder):
        sd.update(load_file(str(f)))
    return {k: v.float() for k, v in sd.items()}


# ---- tokenizer -------------------------------------------------------------------------------------------------
def prepare_tokenizer(folder: Path, out_dir: Path, mask_token: str = "<|mask|>") -> dict:
    """The tokenizer of `folder` saved into `out_dir` with a mask token (reused when present, else a new id) and
    a pad token (its own, else EOS). Returns the pipeline's tokenizer record plus the choice made."""
    # the generic fast class: tokenizer.json and the special tokens as saved (a model-specific class may add its own)
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    if tok.eos_token is None:
        raise ConversionError(f"{folder}: the tokenizer has no eos_token; set one in tokenizer_config.json")
    before = len(tok)
    added = mask_token not in tok.get_vocab()
    if added:
        tok.add_special_tokens({"mask_token": mask_token})
    else:
        tok.mask_token = mask_token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    ids = {r: tok.convert_tokens_to_ids(getattr(tok, r)) for r in ("eos_token", "mask_token", "pad_token")}
    return {
        "path": str(out_dir.resolve()),
        "vocab_size": len(tok),
        "source_vocab_size": before,
        "eos_id": ids["eos_token"],
        "mask_id": ids["mask_token"],
        "pad_id": ids["pad_token"],
        "special_ids": sorted(set(tok.all_special_ids) | set(ids.values())),
        "tokens": {"eos_token": tok.eos_token, "mask_token": mask_token, "pad_token": tok.pad_token},
        "mask_added": added,
    }


def tokenizer_overrides(tokenizer: dict) -> list[str]:
    """`tokenizer.*` overrides that make data prep read through the prepared tokenizer."""
    return [f"tokenizer.path={tokenizer['path']}", *(f"tokenizer.{k}={v}" for k, v in tokenizer["tokens"].items())]


# ---- megatron, one process -------------------------------------------------------------------------------------
@contextlib.contextmanager
def single_megatron(seed: int):
    """A one-process gloo group with megatron's TP=PP=1 state, unless the caller already holds one."""
    from megatron.core import parallel_state, tensor_parallel

    from difflm.models.megatron import compat
    from difflm.models.megatron.distributed import single_process_group

    with single_process_group():
        compat.activate()
        owned = not parallel_state.model_parallel_is_initialized()
        if owned:
            parallel_state.initialize_model_parallel(1, 1)
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        try:
            yield
        finally:  # its groups die with this process group: leave no parallel state pointing at them
            if owned:
                parallel_state.destroy_model_parallel()


def _single(cfg: PipelineConfig, causal: bool = False) -> PipelineConfig:
    """`cfg` at TP=PP=1 on the local spec (conversion runs in one process, with the local spec's parameter
    names on any machine); `causal`: as the `ar` model of the same weights."""
    update = {
        "parallel": cfg.parallel.model_copy(update={"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1})
    }
    launch = cfg.train.launch.model_copy(update={"nproc_per_node": 1, "nnodes": 1})
    update["train"] = cfg.train.model_copy(update={"launch": launch, "precision": "fp32"})
    update["model"] = cfg.model.model_copy(update={"backend": "local"})
    if causal:
        update["diffusion"] = with_mode(cfg, "ar", time_embedding=False).diffusion
        update["model"] = update["model"].model_copy(update={"document_attention": False})
    return cfg.model_copy(update=update)


def megatron_model(
    cfg: PipelineConfig, vocab_size: int, rows: int, weights: dict, strict: bool = True, never_targets=()
):
    """The TP=1 megatron model of `cfg` holding `weights` (megatron local-spec names); `never_targets`: rows an
    `ar` model keeps out of its normaliser besides the padding (`added_rows`)."""
    from difflm.models.megatron.gpt import build_model

    objective = build_objective(cfg.diffusion)  # this model's own (`_single` may make it causal)
    model = build_model(
        cfg, vocab_size, padded_vocab=rows, never_targets=tuple(never_targets), objective=objective
    ).eval()
    expected = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    missing, unexpected = expected - weights.keys(), weights.keys() - expected
    if (strict and missing) or unexpected:
        raise ConversionError(
            f"weights do not fit the megatron model: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    model.load_state_dict(weights, strict=False)
    return model


def megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[b, s, v] on the CPU (megatron builds on the GPU when there is one)."""
    ids = ids.to(next(model.parameters()).device)
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return model(ids, pos, None).float().cpu()


def parity(reference: torch.Tensor, got: torch.Tensor, columns: int, what: str) -> float:
    """Relative max logit difference over the first `columns` (the shared vocabulary); ConversionError above
    PARITY_TOLERANCE."""
    a, b = reference[..., :columns].double(), got[..., :columns].double()
    rel = float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))
    if not rel <= PARITY_TOLERANCE:
        raise ConversionError(
            f"{what}: the converted model's logits differ from the source's by {rel:.2e} (relative max, "
            f"tolerance {PARITY_TOLERANCE:g}): nothing was written; please report this with the source's config.json"
        )
    return rel


def added_rows(tokenizer: dict, source_rows: int) -> tuple[int, ...]:
    """The rows the import added to the source's embedding besides the padding: a new mask token past its
    `source_rows` (never a target of an `ar` model; kept out of its normaliser, its exact NLL is the source's). A
    mask token given a spare row the source has stays in: the source normalises over that row too."""
    return (tokenizer["mask_id"],) if tokenizer.get("mask_added") and tokenizer["mask_id"] >= source_rows else ()


def probe_tokens(cfg: PipelineConfig, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, min(32, cfg.train.seq_length)), generator=torch.Generator().manual_seed(seed))


# ---- import ----------------------------------------------------------------------------------------------------
def _check_model(cfg: PipelineConfig, fields: dict, folder: Path) -> None:
    m = cfg.model
    diff = {k: (v, getattr(m, k)) for k, v in fields.items() if k != "hf_architecture" and getattr(m, k) != v}
    if diff:
        raise ConversionError(
            f"{folder}: the model config differs from the checkpoint ("
            + ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
            + "); add the overrides of difflm.models.hf.importer.source_overrides(folder) (difflm convert prints them)"
        )


def _resize_vocab(ours: dict, vocab: int, tied: bool) -> dict:
    """Vocabulary rows cut to `vocab`, or extended: new input rows at the mean embedding (an added mask token
    starts as an average token), new output rows at zero."""
    out = dict(ours)
    for key in ("embed_tokens.weight", "output_layer.weight"):
        if key not in out or out[key].shape[0] >= vocab:
            out[key] = out[key][:vocab] if key in out else None
            continue
        w = out[key]
        new = w.mean(0, keepdim=True) if key == "embed_tokens.weight" else w.new_zeros(1, w.shape[1])
        out[key] = torch.cat([w, new.expand(vocab - w.shape[0], -1)])
    return {k: v for k, v in out.items() if v is not None}


def import_pretrained(
    cfg: PipelineConfig, folder: str | Path, out_dir: str | Path, tokenizer: dict | None = None
) -> Path:
    """Write a megatron dist checkpoint (model weights only; `train.init_from` loads it at any TP/PP, its
    vocabulary padded for cfg.parallel.tensor_model_parallel_size) of the stock HF model in `folder`.

    `cfg.model` must describe the source (`source_overrides(folder)`). `tokenizer`: the pipeline's tokenizer
    record (a data manifest's) when the data was already prepared through the source's tokenizer with a mask
    token; None: the tokenizer is prepared here (`prepare_tokenizer`) into `<out_dir>/tokenizer`. The logits of
    the imported (causal) model are checked against transformers' on the same tokens before anything is kept."""
    from difflm.models.megatron.gpt import padded_vocab_size  # megatron: lazy (above)

    folder, out_dir = Path(folder).expanduser().resolve(), Path(out_dir).expanduser().resolve()
    arch, c = check_source(folder)
    fields = model_fields(arch, c)
    _check_model(cfg, fields, folder)
    check_replaceable(out_dir, "megatron")
    sd = load_stock_weights(folder)
    if "model.embed_tokens.weight" not in sd:
        raise ConversionError(f"{folder}: no model.embed_tokens.weight: not the weights of a *ForCausalLM")
    rows_src = sd["model.embed_tokens.weight"].shape[0]
    if c.get("vocab_size", rows_src) != rows_src:
        raise ConversionError(f"{folder}: config.json says vocab_size {c['vocab_size']}, the weights have {rows_src}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # both built in folders created here (deleting them on failure deletes nothing else), then swapped in
    tok_tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tokenizer-", dir=out_dir.parent))
    try:
        with outputs.staged_output(out_dir, IMPORT_RECORD, "a megatron checkpoint import") as tmp:
            tok = tokenizer or prepare_tokenizer(folder, tok_tmp, cfg.tokenizer.mask_token)
            source_vocab = tok.get("source_vocab_size", tok["vocab_size"] - 1)
            if source_vocab > rows_src:
                raise ConversionError(
                    f"{folder}: the tokenizer has {source_vocab} tokens but the embedding only {rows_src} rows: "
                    f"the tokenizer is not this model's"
                )
            vocab, tied = tok["vocab_size"], fields["tie_embeddings"]
            try:
                ours = stock_to_ours(sd, Shape.of(cfg.model), fields["num_layers"], tied, arch.layer_names)
                ours = _resize_vocab(ours, vocab, tied)
            except KeyError as err:
                raise ConversionError(
                    f"{folder}: the weights lack {err.args[0]!r} (expected the *ForCausalLM names: "
                    f"model.layers.N..., lm_head.weight unless tie_word_embeddings)"
                ) from None
            del sd  # the host holds one copy of the weights at a time, plus the models built from it
            rows = padded_vocab_size(vocab, cfg.parallel.tensor_model_parallel_size)
            weights = repad_vocab({_local_key(k): v for k, v in ours.items()}, rows)
            del ours
            ids = probe_tokens(cfg, min(rows_src, vocab))
            hf = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32).eval()
            with torch.no_grad():
                ref = hf(ids).logits.float()
            del hf
            with single_megatron(cfg.train.seed):
                from megatron.core import dist_checkpointing

                check = megatron_model(_single(cfg, causal=True), vocab, rows, weights)
                rel = parity(ref, megatron_logits(check, ids), min(rows_src, vocab), f"import of {folder}")
                # the same parameters unless the target conditions on t (its time embedding starts at its own init)
                target = (
                    megatron_model(_single(cfg), vocab, rows, weights, strict=False)
                    if cfg.diffusion.time_embedding
                    else check
                )
                del weights
                dist_checkpointing.save(target.sharded_state_dict(prefix=""), str(tmp))  # tmp: new and empty
            record = {
                "source": str(folder),
                "architecture": arch.hf_class,
                "model": fields,
                "tokenizer": {
                    **{k: tok.get(k) for k in ("path", "vocab_size", "mask_id", "eos_id", "pad_id", "mask_added")},
                    "tokens": tok.get("tokens"),
                    "mask_row_added": bool(added_rows(tok, rows_src)),  # out of an ar export's normaliser
                },
                "parity": {"rel_max_logit_diff": rel, "tolerance": PARITY_TOLERANCE, "tokens": list(ids.shape)},
            }
            if tokenizer is None:  # into the checkpoint folder after megatron's save (it wants an empty folder)
                tok_tmp.replace(tmp / TOKENIZER_DIR)
                record["tokenizer"]["path"] = str(out_dir / TOKENIZER_DIR)
            (tmp / IMPORT_RECORD).write_text(json.dumps(record, indent=2))
    finally:
        shutil.rmtree(tok_tmp, ignore_errors=True)  # ours: created above (gone when moved into the checkpoint)
    return out_dir


def import_record(ckpt_dir: str | Path) -> dict | None:
    """What the stock importer recorded in `ckpt_dir` (source, architecture, tokenizer, parity); None for any
    other checkpoint, including an import of this project's own export, whose marker of the same name only
    names its source (`difflm.models.hf.convert.import_hf`)."""
    path = Path(ckpt_dir) / IMPORT_RECORD
    record = json.loads(path.read_text()) if path.exists() else None
    return record if record and "tokenizer" in record else None


# ---- export to the stock class ---------------------------------------------------------------------------------
def export_stock(
    cfg: PipelineConfig, tokenizer: dict, ckpt_dir: str | Path, out_dir: str | Path, provenance: dict | None = None
) -> Export:
    """Write `ckpt_dir` (a causal model: mode ar) as the stock transformers class of its architecture
    (`model.hf_architecture`, else by its features; a model trained here is a Llama), which
    `AutoModelForCausalLM.from_pretrained(out_dir)` loads without remote code. The mask token choice is recorded
    in config.json (`difflm_mask_token_id`). Logits are checked against the megatron model's; the returned
    `Export` records the figure (`parity`)."""
    from difflm.models.megatron.gpt import padded_vocab_size  # megatron: lazy (above)

    check_exportable(cfg.model)
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    check_replaceable(out_dir, "hf")
    ours = to_hf_state_dict(load_megatron_weights(ckpt_dir))
    rows = ours["embed_tokens.weight"].shape[0]
    if rows != padded_vocab_size(tokenizer["vocab_size"], cfg.parallel.tensor_model_parallel_size):
        raise ConversionError(f"{ckpt_dir}: {rows} vocabulary rows do not fit this config's tokenizer and TP")
    m = cfg.model
    special = {
        "eos_token_id": tokenizer["eos_id"],
        "pad_token_id": tokenizer["pad_id"],
        "difflm_mask_token_id": tokenizer["mask_id"],
        "difflm_real_vocab_size": tokenizer["vocab_size"],
    }
    stock_cfg = stock_config(m, rows, cfg.train.seq_length, special)
    model = AutoModelForCausalLM.from_config(stock_cfg).float().eval()
    stock = ours_to_stock(ours, Shape.of(m), m.num_layers, m.tie_embeddings, architecture_of(m).layer_names)
    missing, unexpected = model.load_state_dict(stock, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and m.tie_embeddings)]
    if missing or unexpected:
        raise ConversionError(
            f"{ckpt_dir}: does not fit {stock_cfg.architectures[0]}: missing {missing}, unexpected {unexpected}"
        )
    ids = probe_tokens(cfg, tokenizer["vocab_size"])
    with single_megatron(cfg.train.seed):
        weights = {_local_key(k): v for k, v in ours.items()}
        # every token's column is compared, the mask's too: the stock class keeps its row (no never_targets here)
        ref = megatron_logits(megatron_model(_single(cfg, causal=True), tokenizer["vocab_size"], rows, weights), ids)
    with torch.no_grad():
        got = model(ids).logits.float()
    rel = parity(ref, got, tokenizer["vocab_size"], f"export of {ckpt_dir}")
    meta = {
        "mode": cfg.diffusion.model_running_mode,
        "architecture": stock_cfg.architectures[0],
        **(provenance or {}),
        "checkpoint": str(ckpt_dir),
        "format": "hf-stock",
        "parity": rel,  # the figure just measured, whatever the caller passed
    }
    return save_export(model, Path(tokenizer["path"]), Export.from_marker(out_dir, meta))
