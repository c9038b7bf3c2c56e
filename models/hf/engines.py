"""A megatron checkpoint in another engine's published layout: LLaDA's (`LLaDAModelLM`) and Dream's (`DreamModel`),
the two diffusion layouts llama.cpp runs (`llama-diffusion-cli`, through a GGUF file: `models/hf/gguf_file.py`).

    export_engine(cfg, tokenizer, ckpt_dir, out_dir, "llada" | "dream" | "gguf") -> Export

Which layout holds which model is the objective's fact (`Objective.engine_layout`: masked diffusion without shift
is LLaDA's, the shifted objective Dream's); the architecture must be the layout's own (LLaDA: a Llama without
biases; Dream: Qwen2, which a Llama is with zero Q/K/V biases), with no time conditioning and no document masks
(the engines attend over the whole input and take no noise level). Anything else is refused in one line that
says which layouts exist and what to use instead.

Parity: the layout's weights run through `layout_logits`, a forward written from the layouts' published
description (LLaDA's modeling and Dream's Qwen2 one: RMSNorm, rotate-half RoPE, non-causal attention, SwiGLU),
not through our model code, and are compared with megatron's logits on the same tokens (the stock export's
check: `difflm.models.hf.importer.parity`); the figure is recorded in the export's marker.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast

from difflm import outputs
from difflm.config import PipelineConfig
from difflm.models.diffusion.arch import ModelArch
from difflm.models.diffusion.modes import MODES, build_objective
from difflm.models.hf.architectures import ARCHITECTURES, Shape, ours_to_stock, split_qkv
from difflm.models.hf.convert import ConversionError, check_replaceable, load_megatron_weights, to_hf_state_dict
from difflm.models.hf.export import Export
from difflm.models.hf.gguf_file import GGUF_FILE, pre_tokenizer, write_gguf
from difflm.models.hf.importer import _local_key, _single, megatron_logits, megatron_model, parity, single_megatron
from difflm.rundir import EXPORT_MARKER

WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class Layout:
    """One engine layout: its HF class and model_type, and the architectures (switch records) it computes."""

    name: str  # "llada" or "dream": the --format value and llama.cpp's GGUF architecture
    hf_class: str
    model_type: str
    archs: tuple[str, ...]  # rows of models/hf/architectures.py whose models it holds


LAYOUTS = {
    "llada": Layout("llada", "LLaDAModelLM", "llada", ("llama",)),
    # a Llama is a Qwen2 with zero Q/K/V biases (the same function exactly), so both go into Dream's layout
    "dream": Layout("dream", "DreamModel", "Dream", ("llama", "qwen2")),
}
ENGINE_FORMATS = ("llada", "dream", "gguf")


def _takes() -> str:
    """'llada (difflm-noshift), dream (difflm-shift)': what each layout holds, read from the objectives."""
    return ", ".join(f"{cls.engine_layout} ({name})" for name, cls in MODES.items() if cls.engine_layout)


def layout_for(cfg: PipelineConfig, fmt: str) -> Layout:
    """The layout a model of `cfg` is written in for `--format fmt` (gguf: the mode's own layout); ConversionError,
    one line, when none holds it."""
    if fmt not in ENGINE_FORMATS:
        raise ConversionError(f"--format {fmt!r}: one of difflm, {', '.join(ENGINE_FORMATS)}")
    objective = build_objective(cfg.diffusion)
    mode, name = cfg.diffusion.model_running_mode, objective.engine_layout
    if name is None and not objective.bidirectional:
        raise ConversionError(
            f"{mode} models are autoregressive, and {fmt} takes diffusion models ({_takes()}): export it as the "
            f"stock transformers class instead (hf-stock: <run>/hf-stock, which the pipeline writes for an ar run)"
        )
    if name is None:
        raise ConversionError(
            f"no engine layout holds {mode} models yet; {fmt} takes {_takes()}: export it in difflm's own layout "
            f"instead (--format difflm: AutoModel with trust_remote_code, `difflm generate`)"
        )
    if fmt != "gguf" and fmt != name:
        raise ConversionError(f"--format {fmt} holds {_held(fmt)} models, this one is {mode}: use --format {name}")
    layout = LAYOUTS[name]
    problem = _arch_problem(cfg, layout, objective.time_conditioned(cfg.diffusion.time_embedding))
    if problem:
        raise ConversionError(f"the {layout.hf_class} layout cannot hold this model: {problem}")
    return layout


def _held(fmt: str) -> str:
    return ", ".join(name for name, cls in MODES.items() if cls.engine_layout == fmt) or "no"


def _arch_problem(cfg: PipelineConfig, layout: Layout, time_conditioned: bool) -> str | None:
    m = cfg.model
    switches = replace(ModelArch.of(m), head_dim=None)
    if switches not in [ARCHITECTURES[a].arch for a in layout.archs]:
        return f"its switches ({switches}) are not those of {' or '.join(layout.archs)}; export it with --format difflm"
    if ModelArch.of(m).head_width(m.hidden_size, m.num_attention_heads) * m.num_attention_heads != m.hidden_size:
        return "model.kv_channels sets a head width apart from hidden_size / heads, which the layout derives"
    if time_conditioned:
        return "it conditions on the noise level t (diffusion.time_embedding), which the engines never pass"
    # model.document_attention is no obstacle: on one document (a prompt and its completion, with no EOS inside:
    # all an engine runs) the document mask is the whole input's, which is what the layouts compute
    return None


# ---- weights and config of a layout ----------------------------------------------------------------------------
def layout_weights(layout: Layout, ours: dict[str, torch.Tensor], cfg: PipelineConfig, vocab: int) -> dict:
    """The state dict of `layout` (its published weight names) from ours (`to_hf_state_dict`), the vocabulary
    cut to the tokenizer's `vocab` rows (megatron's padding is no token: our sampler never draws it either)."""
    m, s = cfg.model, Shape.of(cfg.model)
    ours = {k: v.float() for k, v in ours.items()}
    ours["embed_tokens.weight"] = ours["embed_tokens.weight"][:vocab]
    if "output_layer.weight" in ours:
        ours["output_layer.weight"] = ours["output_layer.weight"][:vocab]
    if layout.name == "dream":
        sd = ours_to_stock(ours, s, m.num_layers, m.tie_embeddings)
        if m.tie_embeddings:  # a tied Qwen2 checkpoint stores no lm_head (Dream's loader ties it)
            del sd["lm_head.weight"]
        for i in range(m.num_layers):  # a Llama's Q/K/V have no bias: zero ones compute the same function
            for x in "qkv":
                key = f"model.layers.{i}.self_attn.{x}_proj"
                sd.setdefault(f"{key}.bias", torch.zeros(sd[f"{key}.weight"].shape[0]))
        return {k: v.contiguous() for k, v in sd.items()}
    # LLaDA's names (its modeling_llada.py, OLMo-derived): ff_proj is the gate (activated), up_proj the up,
    # ff_out the down projection; the head is transformer.ff_out unless weight_tying
    top = "model.transformer."
    sd = {top + "wte.weight": ours["embed_tokens.weight"], top + "ln_f.weight": ours["final_layernorm.weight"]}
    if not m.tie_embeddings:
        sd[top + "ff_out.weight"] = ours["output_layer.weight"]
    for i in range(m.num_layers):
        p, o = f"{top}blocks.{i}.", f"layers.{i}."
        q, k, v = split_qkv(ours[o + "self_attention.linear_qkv.weight"], s)
        gate, up = ours[o + "mlp.linear_fc1.weight"].chunk(2)
        sd.update(
            {
                p + "attn_norm.weight": ours[o + "input_layernorm.weight"],
                p + "q_proj.weight": q,
                p + "k_proj.weight": k,
                p + "v_proj.weight": v,
                p + "attn_out.weight": ours[o + "self_attention.linear_proj.weight"],
                p + "ff_norm.weight": ours[o + "pre_mlp_layernorm.weight"],
                p + "ff_proj.weight": gate,
                p + "up_proj.weight": up,
                p + "ff_out.weight": ours[o + "mlp.linear_fc2.weight"],
            }
        )
    return {k: v.contiguous() for k, v in sd.items()}


def layout_config(layout: Layout, cfg: PipelineConfig, tokenizer: dict) -> dict:
    """config.json of the layout: the names its own config class (and llama.cpp's converter) reads."""
    m = cfg.model
    groups = m.num_query_groups or m.num_attention_heads
    ids = {
        "mask_token_id": tokenizer["mask_id"],
        "eos_token_id": tokenizer["eos_id"],
        "pad_token_id": tokenizer["pad_id"],
        "bos_token_id": tokenizer.get("bos_id", tokenizer["eos_id"]),  # none of ours: EOS separates documents
    }
    if layout.name == "llada":
        return {
            "architectures": [layout.hf_class],
            "model_type": layout.model_type,
            "d_model": m.hidden_size,
            "n_heads": m.num_attention_heads,
            "n_kv_heads": groups,
            "n_layers": m.num_layers,
            "mlp_hidden_size": m.ffn_size,
            "mlp_ratio": m.ffn_size / m.hidden_size,
            "max_sequence_length": cfg.train.seq_length,
            "vocab_size": tokenizer["vocab_size"],
            "embedding_size": tokenizer["vocab_size"],
            "rope_theta": float(m.rotary_base),
            "rms_norm_eps": m.norm_epsilon,
            "activation_type": "silu",
            "block_type": "llama",
            "layer_norm_type": "rms",
            "rope": True,
            "alibi": False,
            "include_bias": False,
            "include_qkv_bias": False,
            "weight_tying": m.tie_embeddings,
            "use_cache": False,
            **ids,
        }
    return {
        "architectures": [layout.hf_class],
        "model_type": layout.model_type,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": groups,
        "num_hidden_layers": m.num_layers,
        "intermediate_size": m.ffn_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.train.seq_length,
        "vocab_size": tokenizer["vocab_size"],
        "rope_theta": float(m.rotary_base),
        "rope_scaling": None,
        "rms_norm_eps": m.norm_epsilon,
        "tie_word_embeddings": m.tie_embeddings,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "use_cache": False,
        **ids,
    }


# ---- the layout's forward, from its published description -------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (both layouts' modeling; llama.cpp's LLaDA graph wants Q/K permuted for its own)."""
    d, s = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def layout_logits(layout: Layout, config: dict, sd: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """[b, s, vocab] logits of the layout's model (config.json `config`, weights `sd`) on `ids`, in float64:
    non-causal attention over the whole input, no shift applied (Dream's model returns raw logits too)."""
    llada = layout.name == "llada"
    c = {k: config[k] for k in config}
    hidden = c["d_model"] if llada else c["hidden_size"]
    heads = c["n_heads"] if llada else c["num_attention_heads"]
    groups = c["n_kv_heads"] if llada else c["num_key_value_heads"]
    layers = c["n_layers"] if llada else c["num_hidden_layers"]
    eps, theta, hd = c["rms_norm_eps"], c["rope_theta"], hidden // heads
    w = {k: v.double() for k, v in sd.items()}
    pre = "model.transformer." if llada else "model."
    x = w[pre + ("wte.weight" if llada else "embed_tokens.weight")][ids]
    b, s = ids.shape
    for i in range(layers):
        p = f"{pre}blocks.{i}." if llada else f"{pre}layers.{i}."
        names = (
            ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj", "up_proj", "ff_out")
            if llada
            else (
                "input_layernorm",
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "post_attention_layernorm",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        )
        n_attn, n_q, n_k, n_v, n_o, n_ff, n_gate, n_up, n_down = (p + n for n in names)
        h = _rms(x, w[n_attn + ".weight"], eps)

        def proj(name: str, h: torch.Tensor = h) -> torch.Tensor:
            out = h @ w[name + ".weight"].T
            return out + w[name + ".bias"] if name + ".bias" in w else out

        q = _rope(proj(n_q).view(b, s, heads, hd).transpose(1, 2), theta)
        k = _rope(proj(n_k).view(b, s, groups, hd).transpose(1, 2), theta)
        v = proj(n_v).view(b, s, groups, hd).transpose(1, 2)
        k, v = k.repeat_interleave(heads // groups, 1), v.repeat_interleave(heads // groups, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), -1)  # no causal mask: both layouts attend fully
        x = x + (att @ v).transpose(1, 2).reshape(b, s, hidden) @ w[n_o + ".weight"].T
        h = _rms(x, w[n_ff + ".weight"], eps)
        x = x + (torch.nn.functional.silu(h @ w[n_gate + ".weight"].T) * (h @ w[n_up + ".weight"].T)) @ (
            w[n_down + ".weight"].T
        )
    x = _rms(x, w[pre + ("ln_f.weight" if llada else "norm.weight")], eps)
    head = pre + "ff_out.weight" if llada else "lm_head.weight"
    return x @ w.get(head, w[pre + ("wte.weight" if llada else "embed_tokens.weight")]).T


# ---- the export ----------------------------------------------------------------------------------------------------
def probe_ids(cfg: PipelineConfig, tokenizer: dict, seed: int = 0) -> torch.Tensor:
    """Tokens both models run on: random real tokens (as the stock export's check), EOS left out, so that each row
    is one document whether or not the model was trained with document masks."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tokenizer["vocab_size"] - 1, (2, min(32, cfg.train.seq_length)), generator=g)
    return ids + (ids >= tokenizer["eos_id"]).long()  # every id but EOS


def megatron_reference(cfg: PipelineConfig, ours: dict, tokenizer: dict, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the megatron model of `cfg` (its own objective: bidirectional) holding `ours`, on `ids`."""
    rows = ours["embed_tokens.weight"].shape[0]
    with single_megatron(cfg.train.seed):
        weights = {_local_key(k): v.float() for k, v in ours.items()}
        return megatron_logits(megatron_model(_single(cfg), tokenizer["vocab_size"], rows, weights), ids)


def export_engine(
    cfg: PipelineConfig,
    tokenizer: dict,
    ckpt_dir: str | Path,
    out_dir: str | Path,
    fmt: str,
    provenance: dict | None = None,
) -> Export:
    """Write `ckpt_dir` into `out_dir` as `fmt` (llada, dream: an HF folder in that layout; gguf: that folder
    and `model.gguf` beside it, in the layout of the mode), its logits checked against megatron's first."""
    layout = layout_for(cfg, fmt)  # every refusal before reading a weight
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    check_replaceable(out_dir, "hf")
    if fmt == "gguf":
        pre_tokenizer(Path(tokenizer["path"]))  # a tokenizer the file cannot name: refused before the work
    ours = to_hf_state_dict(load_megatron_weights(ckpt_dir))
    vocab = tokenizer["vocab_size"]
    sd, config = layout_weights(layout, ours, cfg, vocab), layout_config(layout, cfg, tokenizer)
    ids = probe_ids(cfg, tokenizer)
    ref = megatron_reference(cfg, ours, tokenizer, ids)
    rel = parity(ref, layout_logits(layout, config, sd, ids).float(), vocab, f"{layout.name} export of {ckpt_dir}")
    meta = {
        "mode": cfg.diffusion.model_running_mode,
        "layout": layout.hf_class,
        **(provenance or {}),
        "checkpoint": str(ckpt_dir),
        "format": fmt,
        "parity": rel,  # the layout's reference forward against megatron, just measured
        "parity_tokens": list(ids.shape),
    }
    export = Export.from_marker(out_dir, meta)
    with outputs.staged_output(out_dir, EXPORT_MARKER, "an HF export") as tmp:
        write_layout(tmp, sd, config, Path(tokenizer["path"]), tokenizer)
        if fmt == "gguf":
            name = f"{cfg.name}-{cfg.diffusion.model_running_mode}"  # general.name: the preset and the mode
            gguf_meta = write_gguf(tmp, layout, config, sd, tmp / GGUF_FILE, name)
            meta = {**meta, **gguf_meta}
            export = Export.from_marker(out_dir, meta)
        export.write(into=tmp)
    return export


def write_layout(folder: Path, sd: dict, config: dict, tokenizer_dir: Path, tokenizer: dict) -> None:
    """Weights, config.json and the tokenizer (its mask token named in tokenizer_config.json) into `folder`."""
    save_file(sd, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy2(f, folder / f.name)
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    mask = tok.convert_ids_to_tokens(tokenizer["mask_id"])
    tok.mask_token = mask
    tok.pad_token = tok.convert_ids_to_tokens(tokenizer["pad_id"])
    tok.eos_token = tok.convert_ids_to_tokens(tokenizer["eos_id"])
    tok.save_pretrained(str(folder))
