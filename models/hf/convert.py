"""Megatron distributed checkpoint -> Hugging Face folder (safetensors, config, tokenizer, model code).

megatron stores a backend-neutral layout: layer tensors stacked on a leading [num_layers] axis,
layer norms under the linear they precede (TE naming), QKV grouped per query group, GLU rows as
[gate; up], full (unsharded) shapes whatever the TP/PP of the run. We map that onto
`models/hf/modeling_difflm.py`, which computes the same function. Reading and writing megatron checkpoints
goes through megatron-core (and, for HF -> megatron, our model build), so this bridge is the one module of
`difflm.models.hf` that imports `difflm.models.megatron`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM

from difflm import outputs
from difflm.config import PipelineConfig
from difflm.errors import UserError
from difflm.models.diffusion.arch import ModelArch
from difflm.models.diffusion.modes import build_objective
from difflm.models.hf.configuration_difflm import DiffLMConfig
from difflm.models.hf.export import Export
from difflm.models.hf.modeling_difflm import DiffLMForMaskedLM
from difflm.rundir import EXPORT_MARKER

# megatron (difflm.models.megatron, megatron.core) is imported inside the functions that run it: the HF side of the
# project (exports, evaluation, the importer's checks) loads without it


class ConversionError(UserError, RuntimeError):
    """The source cannot be converted (unknown layout, architecture mismatch); the message says why."""


def _inside(path: Path, folder: Path) -> bool:
    """`path` resolves into `folder` (resolved), or into the blob store of the Hugging Face cache `folder` is a
    snapshot of (`<repo>/snapshots/<rev>/<file>` links to `<repo>/blobs/<hash>`: the hub's own layout)."""
    target = path.resolve()
    if target.is_relative_to(folder):
        return True
    return folder.parent.name == "snapshots" and target.parent == folder.parent.parent / "blobs"


def check_inside(folder: Path, names: list[str] | tuple[str, ...] = ()) -> None:
    """Refuse a model folder whose files (weights, config, tokenizer: every file in it, and `names`, relative
    paths it names, such as a shard index's weight map) resolve outside it: a symlink to another file or an
    absolute or `../` name would make an import read, and copy into its output, what the folder's owner chose."""
    root = Path(folder).resolve()
    entries = [  # every file and folder under it, symlinked folders not entered (os.walk does not follow them)
        (name, Path(top) / name) for top, dirs, files in os.walk(folder) for name in sorted([*dirs, *files])
    ]
    for name in names:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ConversionError(
                f"{folder}: the weight file name {name!r} points outside the folder; shards must be files in it"
            )
        entries.append((name, Path(folder) / name))
    for name, path in entries:
        if not _inside(path, root):
            raise ConversionError(
                f"{folder}: {path.relative_to(folder) if path.is_relative_to(folder) else name} resolves outside "
                f"the folder ({path.resolve()}); copy the files into it (cp -L) instead of linking them"
            )


# adaLN norms: megatron's local spec renames "input_layernorm." to "self_attention.linear_qkv.layer_norm_" (TE
# naming) in checkpoints, so their modulation MLPs land under that prefix too
_ADALN_PREFIXES = ("input_layernorm.modulation.", "pre_mlp_layernorm.modulation.")
_ADALN_RENAMES = {
    "self_attention.linear_qkv.layer_norm_modulation.": "input_layernorm.modulation.",
    "mlp.linear_fc1.layer_norm_modulation.": "pre_mlp_layernorm.modulation.",
}


def _adaln_key(sub: str) -> str:
    for theirs, ours in _ADALN_RENAMES.items():
        if sub.startswith(theirs):
            return ours + sub[len(theirs) :]
    return sub


_HF_DIR = Path(__file__).resolve().parent
_DIFFUSION_DIR = _HF_DIR.parent / "diffusion"
HF_CODE_FILES = ("configuration_difflm.py", "modeling_difflm.py")
# The Auto classes an export answers to with trust_remote_code. AutoModel too: LLaDA and Dream users load
# with `AutoModel.from_pretrained(path, trust_remote_code=True, dtype=torch.bfloat16)`; AutoModelForCausalLM as
# LLaDA2 users and diffusers' LLaDA2Pipeline do (a block-diffusion model then applies its decoding rule itself).
AUTO_MAP = {
    "AutoConfig": "configuration_difflm.DiffLMConfig",
    "AutoModel": "modeling_difflm.DiffLMForMaskedLM",
    "AutoModelForMaskedLM": "modeling_difflm.DiffLMForMaskedLM",
    "AutoModelForCausalLM": "modeling_difflm.DiffLMForMaskedLM",
}
_PACKAGE_IMPORT = re.compile(r"^from \.\.diffusion\.(\w+) import", re.MULTILINE)


def export_code() -> dict[str, str]:
    """{file name: source} of the model code an export folder ships: our HF modules and every module of
    `models/diffusion/` (not its `__init__`), flat, with package-relative imports made folder-relative."""
    files = {p.name: p.read_text() for p in sorted(_DIFFUSION_DIR.glob("*.py")) if p.name != "__init__.py"}
    for name in HF_CODE_FILES:
        files[name] = _PACKAGE_IMPORT.sub(r"from .\1 import", (_HF_DIR / name).read_text())
    for name, src in files.items():  # anything else would not resolve inside the export folder
        if re.search(r"^from \.\.", src, re.MULTILINE) or re.search(r"^\s*(from|import) models\b", src, re.MULTILINE):
            raise ConversionError(f"{name}: an import that cannot resolve inside an export folder")
    return files


# megatron per-layer key (after "decoder.layers.") -> our per-layer key
_LAYER_KEYS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "self_attention.linear_qkv.weight": "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias": "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight": "self_attention.linear_proj.weight",
    "self_attention.q_layernorm.weight": "self_attention.q_norm.weight",
    "self_attention.q_layernorm.bias": "self_attention.q_norm.bias",
    "self_attention.k_layernorm.weight": "self_attention.k_norm.weight",
    "self_attention.k_layernorm.bias": "self_attention.k_norm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
}
_TOP_KEYS = {
    "embedding.word_embeddings.weight": "embed_tokens.weight",
    "decoder.final_layernorm.weight": "final_layernorm.weight",
    "decoder.final_layernorm.bias": "final_layernorm.bias",
    "output_layer.weight": "output_layer.weight",
}


def load_megatron_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) model tensors of a megatron dist checkpoint, optimizer state left on disk."""
    from megatron.core import dist_checkpointing  # megatron: lazy (above)

    from difflm.models.megatron.distributed import single_process_group
    from difflm.models.megatron.safe_pickle import check_common, guard_dcp

    if not (Path(ckpt_dir) / "metadata.json").exists():
        raise ConversionError(f"{ckpt_dir} is not a megatron distributed checkpoint (no metadata.json)")
    guard_dcp()  # .metadata is a pickle: read it without running code
    check_common(ckpt_dir)  # a crafted common.pt: one line, not torch's page
    with single_process_group():
        meta = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
        wanted = {k: v for k, v in meta.items() if not k.startswith("optimizer.")}
        return dist_checkpointing.load(wanted, str(ckpt_dir))


def to_hf_state_dict(mg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in mg.items():
        if key in _TOP_KEYS:
            out[_TOP_KEYS[key]] = tensor
        elif key.startswith("time_embedding."):  # same module, same names on both sides
            out[key] = tensor
        elif key.startswith("decoder.layers."):
            sub = _adaln_key(key[len("decoder.layers.") :])
            if sub not in _LAYER_KEYS and not sub.startswith(_ADALN_PREFIXES):
                raise ConversionError(f"no mapping for megatron tensor {key!r}")
            for i in range(tensor.shape[0]):
                out[f"layers.{i}.{_LAYER_KEYS.get(sub, sub)}"] = tensor[i].clone()
        elif not isinstance(tensor, torch.Tensor) or key.endswith("_extra_state"):
            continue  # common (non-tensor) state: iteration, scheduler, optimizer param groups
        else:
            raise ConversionError(f"no mapping for megatron tensor {key!r}")
    return out


def hf_config(cfg: PipelineConfig, tokenizer: dict):
    from difflm.models.megatron.gpt import padded_vocab_size  # megatron: lazy (above)

    m, objective = cfg.model, build_objective(cfg.diffusion)  # the export's: built once, written as one entry
    return DiffLMConfig(
        vocab_size=padded_vocab_size(tokenizer["vocab_size"], cfg.parallel.tensor_model_parallel_size),
        real_vocab_size=tokenizer["vocab_size"],
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups or m.num_attention_heads,
        intermediate_size=m.ffn_size,
        architecture=ModelArch.of(m).to_dict(),
        norm_eps=m.norm_epsilon,
        rope_theta=float(m.rotary_base),
        max_position_embeddings=cfg.train.seq_length,
        bidirectional=objective.bidirectional,
        objective=objective.to_dict(),
        mask_token_id=tokenizer["mask_id"],
        mask_token_added=bool(tokenizer.get("mask_added")),
        time_embedding=objective.time_conditioned(cfg.diffusion.time_embedding),
        document_attention=cfg.model.document_attention,
        time_conditioning=cfg.diffusion.time_conditioning,
        special_ids=tokenizer.get("special_ids") or [tokenizer["eos_id"], tokenizer["mask_id"], tokenizer["pad_id"]],
        eos_token_id=tokenizer["eos_id"],
        pad_token_id=tokenizer["pad_id"],
        tie_word_embeddings=m.tie_embeddings,
        initializer_range=m.init_method_std,
        auto_map=dict(AUTO_MAP),
    )


def export_hf(
    cfg: PipelineConfig, tokenizer: dict, ckpt_dir: Path, out_dir: Path, provenance: dict | None = None
) -> Export:
    """Write the HF folder for `ckpt_dir` into `out_dir` (replaced atomically); returns its `Export` record.
    `provenance`: what the caller knows of the run (`data_hash`, and more keys the marker keeps); the mode is the
    config's. No parity figure: the folder ships the code the model was trained with, not a reimplementation."""
    hf_sd = to_hf_state_dict(load_megatron_weights(ckpt_dir))
    model = DiffLMForMaskedLM(hf_config(cfg, tokenizer))
    missing, unexpected = model.load_state_dict(hf_sd, strict=False)
    if missing or unexpected:
        raise ConversionError(f"checkpoint does not match the config: missing {missing}, unexpected {unexpected}")
    meta = {"mode": cfg.diffusion.model_running_mode, **(provenance or {}), "checkpoint": str(ckpt_dir)}
    return save_export(model, Path(tokenizer["path"]), Export.from_marker(out_dir, {**meta, "format": "difflm"}))


IMPORT_MARKER = "difflm_import.json"  # in a megatron checkpoint written by import_hf: {"source": the HF folder}
_MARKERS = {"hf": (EXPORT_MARKER, "an HF export"), "megatron": (IMPORT_MARKER, "a megatron checkpoint import")}


def check_replaceable(out_dir: Path, kind: str) -> None:
    """`out_dir` may be (re)written: it does not exist, is empty, or holds an earlier output of the same kind,
    recognised by a marker file only difflm writes (an HF export: difflm_export.json; an imported megatron
    checkpoint: difflm_import.json). Anything else is never deleted."""
    marker, what = _MARKERS[kind]
    outputs.check_replaceable(out_dir, marker, what)


def save_export(model, tokenizer_dir: Path, export: Export) -> Export:
    """Weights, config, model code (a "difflm" export only: a stock class needs none) and tokenizer of `model`
    into `export.folder` (replaced atomically, and only when it is empty or an earlier export), its marker
    written by `Export.write`."""
    with outputs.staged_output(export.folder, EXPORT_MARKER, "an HF export") as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        for name, src in export_code().items() if export.format == "difflm" else ():
            (tmp / name).write_text(src)
        for f in Path(tokenizer_dir).iterdir():
            shutil.copy2(f, tmp / f.name)
        # names the checkpoint (difflm.rundir.exported_from) and marks the folder as ours
        export.write(into=tmp)
    return export


def load_hf(folder: Path):
    """Load an export offline through transformers' remote-code path, as users will."""
    return AutoModelForMaskedLM.from_pretrained(str(folder), trust_remote_code=True, local_files_only=True).eval()


# ---- Hugging Face -> megatron ----------------------------------------------------------------------
# our per-layer HF key -> megatron local-spec module key (the inverse of the export, before stacking)
_HF_TO_LOCAL = {
    "input_layernorm": "input_layernorm",
    "self_attention.q_norm": "self_attention.q_layernorm",
    "self_attention.k_norm": "self_attention.k_layernorm",
    "pre_mlp_layernorm": "pre_mlp_layernorm",
}


def _local_key(hf_key: str) -> str:
    if hf_key.startswith("embed_tokens."):
        return "embedding.word_embeddings." + hf_key.split(".", 1)[1]
    if hf_key.startswith("final_layernorm.") or hf_key.startswith("layers."):
        if hf_key.startswith("final_layernorm."):
            return "decoder." + hf_key
        _, idx, rest = hf_key.split(".", 2)
        for ours, theirs in _HF_TO_LOCAL.items():
            if rest.startswith(ours + "."):
                rest = theirs + rest[len(ours) :]
        return f"decoder.layers.{idx}.{rest}"
    return hf_key  # output_layer.*, time_embedding.*


def _check_compatible(cfg: PipelineConfig, hf_cfg: dict, tokenizer: dict) -> None:
    want = hf_config(cfg, tokenizer).to_dict()
    # the TRUE vocabulary, not the padded one: padding depends on the TP size of the run that wrote it
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "architecture",
        "tie_word_embeddings",
        "time_embedding",
        "real_vocab_size",
        "time_conditioning",
    )
    if not want.get("time_embedding"):  # how t would enter matters only when it does
        keys = keys[:-1]
    old_defaults = {"time_conditioning": "input"}  # exports written before the field
    hf_cfg = {**hf_cfg, "architecture": ModelArch.from_hf_config(hf_cfg).to_dict()}  # old exports: flat fields
    diff = {
        k: (hf_cfg.get(k, old_defaults.get(k)), want.get(k))
        for k in keys
        if hf_cfg.get(k, old_defaults.get(k)) != want.get(k)
    }
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
        raise ConversionError(
            f"the HF checkpoint does not match the model config ({detail}); set the model.* / "
            f"diffusion.* fields to the checkpoint's values"
        )


def repad_vocab(weights: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """Vocabulary-sized tensors cut or zero-padded to `rows` (megatron pads the vocabulary to a multiple of
    64 x TP, so 3,871 tokens are 3,904 rows at TP=1 and 3,968 at TP=2). Rows past the true vocabulary are
    never targets; new ones start at zero."""
    out = dict(weights)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in out and out[key].shape[0] != rows:
            w = out[key][:rows]
            out[key] = torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])]) if w.shape[0] < rows else w
    return out


def import_hf(cfg: PipelineConfig, hf_dir: Path, out_dir: Path, tokenizer: dict) -> Path:
    """Write a megatron dist checkpoint (model weights only, reshardable on load) from an HF folder of this
    project's format, its vocabulary padded for `cfg`'s TP size; `train.init_from` can start training from it."""
    from difflm.models.megatron.distributed import single_process_group  # megatron: lazy (above)
    from difflm.models.megatron.gpt import padded_vocab_size

    hf_dir = Path(hf_dir)
    if not (hf_dir / "model.safetensors").exists() or not (hf_dir / "config.json").exists():
        raise ConversionError(f"{hf_dir}: expected a Hugging Face folder with config.json and model.safetensors")
    check_inside(hf_dir)
    check_replaceable(out_dir, "megatron")  # before any work
    _check_compatible(cfg, json.loads((hf_dir / "config.json").read_text()), tokenizer)
    rows = padded_vocab_size(tokenizer["vocab_size"], cfg.parallel.tensor_model_parallel_size)
    weights = repad_vocab({_local_key(k): v for k, v in load_file(str(hf_dir / "model.safetensors")).items()}, rows)
    with single_process_group():
        from megatron.core import parallel_state, tensor_parallel

        from difflm.models.megatron import compat
        from difflm.models.megatron.gpt import build_model

        compat.activate()
        owned = not parallel_state.model_parallel_is_initialized()
        if owned:
            parallel_state.initialize_model_parallel(1, 1)
            tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
        single = cfg.model_copy(
            update={
                "parallel": cfg.parallel.model_copy(
                    update={"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
                )
            }
        )
        try:
            model = build_model(
                single, tokenizer["vocab_size"], padded_vocab=rows, objective=build_objective(single.diffusion)
            )
            _save_megatron(model, weights, out_dir, hf_dir)
        finally:  # its groups die with this process group: leave no parallel state pointing at them
            if owned:
                parallel_state.destroy_model_parallel()
    return out_dir


def _save_megatron(model, weights: dict, out_dir: Path, source: Path) -> None:
    from megatron.core import dist_checkpointing

    expected = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    missing, unexpected = expected - weights.keys(), weights.keys() - expected
    if missing or unexpected:
        raise ConversionError(
            f"HF weights do not fit the megatron model: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    model.load_state_dict(weights, strict=False)
    with outputs.staged_output(Path(out_dir), IMPORT_MARKER, "a megatron checkpoint import") as tmp:
        dist_checkpointing.save(model.sharded_state_dict(prefix=""), str(tmp))
        (tmp / IMPORT_MARKER).write_text(json.dumps({"source": str(source)}, indent=2))
