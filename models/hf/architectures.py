"""The stock transformers decoders we import and export (Llama, Qwen2, Qwen3, Mistral, Gemma), as one table.

Every one is the same pre-norm RoPE decoder with a gated MLP; they differ in the switches of the architecture
record each row sets (`models/diffusion/arch.py`: the activation, a (1 + w) norm and scaled embeddings for Gemma,
biases on Q/K/V, a norm on each query and key head; the head width comes from each config.json) and in how a
config spells sliding windows. Each row names its per-layer weight map; today all share one, between the stock layout
(`model.layers.{i}.self_attn.q_proj.weight`, ...) and this project's (`layers.{i}.self_attention.linear_qkv.weight`,
the layout of `modeling_difflm.py` and, key for key, of megatron-core's local spec): Q/K/V fused and grouped per
query group ([q_1..q_n, k, v] per group, as Megatron-Bridge's QKVMapping), gate and up fused as [gate; up] (the
full tensor: megatron's own sharded state dict cuts each half per TP rank on load).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import AutoConfig

from difflm.models.diffusion.arch import ModelArch
from difflm.models.hf.convert import ConversionError

# per-layer: stock name (after "model.layers.{i}.") -> ours (after "layers.{i}."), the tensors copied as they are
LLAMA_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_norm.weight",
    "self_attn.k_norm.weight": "self_attention.k_norm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_TOP_COPY = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "final_layernorm.weight"}


@dataclass(frozen=True)
class Architecture:
    """What sets one stock decoder apart from the others: the network's switches (`ModelArch`, all but the head
    width, which each config.json states), how its config spells them, and its weight names."""

    name: str  # config.json's model_type, and model.hf_architecture
    hf_class: str  # transformers' *ForCausalLM class
    arch: ModelArch  # gated MLP, activation, norm and offset, embedding scale, qk-norm, qkv bias
    window_switch: str | None  # config field that turns the sliding window on; None: a set sliding_window does
    hidden_act: tuple[str, ...] = ("silu",)  # config.json's hidden_act spellings of arch.activation (first: written)
    layer_names: dict[str, str] = field(default_factory=lambda: LLAMA_LAYER_NAMES)  # stock -> ours, per layer


_LLAMA = ModelArch()
ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture("llama", "LlamaForCausalLM", _LLAMA, window_switch=None),
        Architecture("mistral", "MistralForCausalLM", _LLAMA, window_switch=None),
        Architecture("qwen2", "Qwen2ForCausalLM", replace(_LLAMA, qkv_bias=True), window_switch="use_sliding_window"),
        Architecture("qwen3", "Qwen3ForCausalLM", replace(_LLAMA, qk_norm=True), window_switch="use_sliding_window"),
        Architecture(
            "gemma",
            "GemmaForCausalLM",
            ModelArch(activation="gelu_tanh", norm_offset=1, embedding_scale=True),
            window_switch=None,
            hidden_act=("gelu_pytorch_tanh", "gelu_tanh", "gelu"),  # transformers reads a legacy "gelu" as tanh
        ),
    )
}
SUPPORTED = ", ".join(a.hf_class for a in ARCHITECTURES.values())
# decoders close to these whose extra parts have no switch: refused with the reason
_NOT_BUILT = {
    t: "norms after attention and MLP (post-norms), logit soft-capping and alternating sliding windows are not "
    "implemented"
    for t in ("gemma2", "gemma3", "gemma3_text")
}


def architecture_of(model_cfg) -> Architecture:
    """The stock class a model of this project exports to: the recorded one, else the first whose switches the
    model has (a model trained here with the defaults is a Llama)."""
    if model_cfg.hf_architecture:
        return ARCHITECTURES[model_cfg.hf_architecture]
    switches = replace(ModelArch.of(model_cfg), head_dim=None)
    return next((a for a in ARCHITECTURES.values() if a.arch == switches), ARCHITECTURES["llama"])


# ---- reading a stock folder's config ---------------------------------------------------------------------------
def config_json(folder: Path) -> dict:
    """The parsed config.json of an HF folder; ConversionError, one line, when it is not a JSON object."""
    path = Path(folder) / "config.json"
    try:
        c = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConversionError(f"{path} is not valid JSON ({err}): restore it from the model's original files") from None
    if not isinstance(c, dict):
        raise ConversionError(
            f"{path} holds a {type(c).__name__}, not a JSON object: restore it from the model's files"
        )
    return c


def read_config(folder: Path) -> tuple[Architecture, dict]:
    """(architecture, config.json) of a stock HF folder; ConversionError naming the fix for what we do not build."""
    path = Path(folder) / "config.json"
    if not path.exists():
        raise ConversionError(f"{folder}: no config.json; pass a Hugging Face model folder ({SUPPORTED})")
    c = config_json(folder)
    arch = ARCHITECTURES.get(c.get("model_type"))
    if c.get("model_type") in _NOT_BUILT:
        raise ConversionError(f"{folder}: {c['model_type']}: {_NOT_BUILT[c['model_type']]}; import one of {SUPPORTED}")
    if arch is None:
        found = (c.get("architectures") or [c.get("model_type")])[0]
        raise ConversionError(f"{folder}: {found} is not supported; import one of {SUPPORTED}")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise ConversionError(
            f"{folder}: RoPE scaling {kind!r} is not implemented (plain RoPE only); use a checkpoint without "
            f"rope_scaling, or remove it from config.json if you train at the original context length"
        )
    window = c.get("sliding_window") if (arch.window_switch is None or c.get(arch.window_switch)) else None
    if window:
        raise ConversionError(
            f"{folder}: sliding-window attention (sliding_window={window}) is not implemented; if your sequences "
            f"never exceed it, set sliding_window to null in config.json"
        )
    act = c.get("hidden_act", arch.hidden_act[0])
    if act not in arch.hidden_act or c.get("attention_bias") and not arch.arch.qkv_bias or c.get("mlp_bias"):
        raise ConversionError(
            f"{folder}: hidden_act={act!r}, attention_bias={c.get('attention_bias')}, mlp_bias={c.get('mlp_bias')}: "
            f"{arch.hf_class} is built with {arch.hidden_act[0]} and no o_proj/MLP biases"
        )
    return arch, c


def rope_theta(c: dict) -> int:
    theta = float((c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta") or 10000.0)
    if theta != int(theta):
        raise ConversionError(f"rope_theta={theta} is not a whole number (model.rotary_base is one)")
    return int(theta)


def model_fields(arch: Architecture, c: dict) -> dict:
    """The `model.*` fields of this project's config that build the stock model's function."""
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    switches = replace(arch.arch, head_dim=None if head_dim * heads == c["hidden_size"] else head_dim)
    return {
        "num_layers": c["num_hidden_layers"],
        "hidden_size": c["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": c.get("num_key_value_heads") or heads,
        "ffn_hidden_size": c["intermediate_size"],
        **switches.model_fields(),
        "norm_epsilon": c.get("rms_norm_eps", 1e-6),
        "rotary_base": rope_theta(c),
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "hf_architecture": arch.name,
    }


# ---- weights: stock <-> ours ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    heads: int
    groups: int
    head_dim: int

    @classmethod
    def of(cls, model_cfg) -> Shape:
        heads = model_cfg.num_attention_heads
        return cls(heads, model_cfg.num_query_groups or heads, model_cfg.kv_channels or model_cfg.hidden_size // heads)


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Shape) -> torch.Tensor:
    """[q_1..q_n, k, v] per query group (n = heads / groups), rows of head_dim; weights [., hidden] or biases."""
    per = s.heads // s.groups
    rest = q.shape[1:]
    q = q.reshape(s.groups, per * s.head_dim, *rest)
    k, v = k.reshape(s.groups, s.head_dim, *rest), v.reshape(s.groups, s.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, s: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per = s.heads // s.groups
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(s.groups, (per + 2) * s.head_dim, *rest).split(
        [per * s.head_dim, s.head_dim, s.head_dim], dim=1
    )
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def stock_to_ours(
    sd: dict[str, torch.Tensor], s: Shape, layers: int, tied: bool, names: dict[str, str] = LLAMA_LAYER_NAMES
) -> dict[str, torch.Tensor]:
    """A stock state dict in this project's layout (modeling_difflm's names); `names`: the row's per-layer map."""
    out = {ours: sd[theirs] for theirs, ours in _TOP_COPY.items()}
    if not tied:
        out["output_layer.weight"] = sd["lm_head.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        for theirs, ours in names.items():
            if p + theirs in sd:
                out[f"layers.{i}.{ours}"] = sd[p + theirs]
        for kind in ("weight", "bias"):
            if p + f"self_attn.q_proj.{kind}" in sd:
                qkv = [sd[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv"]
                out[f"layers.{i}.self_attention.linear_qkv.{kind}"] = merge_qkv(*qkv, s)
        out[f"layers.{i}.mlp.linear_fc1.weight"] = torch.cat(
            [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
        )
    return out


def ours_to_stock(
    sd: dict[str, torch.Tensor], s: Shape, layers: int, tied: bool, names: dict[str, str] = LLAMA_LAYER_NAMES
) -> dict[str, torch.Tensor]:
    """This project's layout in the stock names (the inverse of `stock_to_ours`)."""
    out = {theirs: sd[ours] for theirs, ours in _TOP_COPY.items()}
    out["lm_head.weight"] = sd["embed_tokens.weight"] if tied else sd["output_layer.weight"]
    for i in range(layers):
        p, ours = f"model.layers.{i}.", f"layers.{i}."
        for theirs, mine in names.items():
            if ours + mine in sd:
                out[p + theirs] = sd[ours + mine]
        for kind in ("weight", "bias"):
            if ours + f"self_attention.linear_qkv.{kind}" in sd:
                q, k, v = split_qkv(sd[ours + f"self_attention.linear_qkv.{kind}"], s)
                out.update({p + f"self_attn.q_proj.{kind}": q, p + f"self_attn.k_proj.{kind}": k})
                out[p + f"self_attn.v_proj.{kind}"] = v
        gate, up = sd[ours + "mlp.linear_fc1.weight"].chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
    return out


def stock_config(model_cfg, vocab_rows: int, max_positions: int, special: dict):
    """The transformers config of the stock class for a model of this project (`special`: token ids and the
    mask choice, recorded as `difflm_mask_token_id` / `difflm_mask_token_added` so the export says it)."""
    m, arch = model_cfg, architecture_of(model_cfg)
    kwargs = dict(
        vocab_size=vocab_rows,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups or m.num_attention_heads,
        head_dim=ModelArch.of(m).head_width(m.hidden_size, m.num_attention_heads),
        hidden_act=arch.hidden_act[0],
        rms_norm_eps=m.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
        max_position_embeddings=max_positions,
        tie_word_embeddings=m.tie_embeddings,
        architectures=[arch.hf_class],
        **special,
    )
    if arch.window_switch is None and arch.name == "mistral":
        kwargs["sliding_window"] = None
    return AutoConfig.for_model(arch.name, **kwargs)


def stock_problem(model_cfg) -> str | None:
    """Why no stock class computes this model, or None: the switches of the model (`ModelArch`, head width aside)
    must be those of a row of the table (document attention is no stock class's either: packed documents would
    see each other)."""
    m, arch = model_cfg, architecture_of(model_cfg)
    switches = replace(ModelArch.of(m), head_dim=None)
    if m.document_attention:
        return "model.document_attention: the stock classes attend across packed documents"
    if switches != arch.arch:
        which = f"model.hf_architecture={arch.name}" if m.hf_architecture else "no stock class"
        return f"{which} has the switches of this model ({switches}; {SUPPORTED} have those of their rows)"
    return None


def check_exportable(model_cfg) -> None:
    problem = stock_problem(model_cfg)
    if problem:
        raise ConversionError(f"{problem}; export it with this project's class (difflm convert)")
