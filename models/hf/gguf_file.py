"""The GGUF file of an engine layout (`models/hf/engines.py`), which llama.cpp's `llama-diffusion-cli` runs.

We write it ourselves with the `gguf` package (PyPI 0.19) from the layout's weights rather than running
llama.cpp's `convert_hf_to_gguf.py` on the layout folder, for two reasons: the converter names a BPE
pre-tokenizer by the hash of a fixed text's encoding, so it refuses a tokenizer our data prep trained (this
writer names it from the tokenizer's own description: `pre_tokenizer`), and an export then needs neither the
76 MB llama.cpp source nor its build. What the converter writes for the same folder (keys, tensor names, the Q/K
permutation for LLaDA, shapes) is what this writes: tests/integration/test_engine_exports.py runs the converter
from the llama-cpp-python sdist and compares, so a change on either side shows.

As llama.cpp's own conversions: the architecture is `llada` or `dream`; attention is non-causal; LLaDA's file
says `diffusion.shift_logits=false` (Dream's says nothing: the CLI then shifts, Dream's convention); the
tokenizer is `gpt2` (byte-level BPE) with its merges and `tokenizer.ggml.mask_token_id`. LLaDA's graph applies
llama.cpp's interleaved ("normal") RoPE, so its Q and K rows are permuted from the rotate-half order of the
layout (each head's first and second halves interleaved); Dream's graph uses the rotate-half ("neox") order as
stored. Every tensor is float32 (file type ALL_F32): the file computes the layout's function exactly, and
llama.cpp's `llama-quantize` makes smaller ones from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from difflm.models.hf.convert import ConversionError

GGUF_FILE = "model.gguf"
# llama-diffusion-cli always formats the prompt with the file's chat template, and with ChatML when the file has none
# (examples/diffusion/diffusion-cli.cpp, format_input_text; no flag of that example turns it off): a base model
# would see every prompt wrapped in <|im_start|>user ... <|im_start|>assistant, which it never saw in training.
# A tokenizer without a chat template of its own gets this one, which renders the prompt as it is: the tokens
# llama.cpp runs are then the ones `difflm generate` runs (tests/integration/test_llama_cpp.py).
PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
_SMOLLM_FIRST = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # SmolLM/SmolLM2's vocabulary opens with these


def pre_tokenizer(folder: Path) -> str:
    """llama.cpp's name of the pre-tokenizer of the tokenizer in `folder` (tokenizer.json), told from what it is:
    a byte-level BPE with GPT-2's split is "gpt-2" (the tokenizer our data prep trains); one that splits digits
    one by one first, or SmolLM's vocabulary (whose digits are single tokens: the same split), is "smollm".
    ConversionError for any other, naming the way out."""
    spec = json.loads((Path(folder) / "tokenizer.json").read_text())
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    byte_level = parts and parts[-1].get("type") == "ByteLevel" and parts[-1].get("use_regex", True)
    if spec.get("model", {}).get("type") == "BPE" and byte_level and not parts[-1].get("add_prefix_space"):
        if kinds == ["ByteLevel"]:
            vocab = spec["model"]["vocab"]
            first = tuple(sorted(vocab, key=vocab.get)[:3])
            return "smollm" if first == _SMOLLM_FIRST and len(vocab) == 49152 else "gpt-2"
        if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
            return "smollm"
    raise ConversionError(
        f"{folder}: the tokenizer's pre-tokenizer ({kinds or 'none'}) is not one this export names for llama.cpp "
        f"(byte-level BPE: gpt-2, smollm); export --format llada or dream and convert that folder with llama.cpp's "
        f"convert_hf_to_gguf.py"
    )


def chat_template(folder: Path) -> str:
    """The tokenizer's own chat template (tokenizer_config.json, as llama.cpp's converter copies it), else
    PLAIN_TEMPLATE."""
    config = folder / "tokenizer_config.json"
    found = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    return found if isinstance(found, str) and found else PLAIN_TEMPLATE


def tokenizer_vocab(folder: Path, rows: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tokenizer in `folder` over `rows` ids, as llama.cpp's `gpt2` model
    lists them: added special tokens CONTROL, other added ones USER_DEFINED, ids without a token UNUSED."""
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(rows):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(by_id[i])
        if by_id[i] not in added:
            types.append(gguf.TokenType.NORMAL)
        elif i in decoder and not decoder[i].special:
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.CONTROL)
    merges = json.loads((Path(folder) / "tokenizer.json").read_text())["model"].get("merges", [])
    return tokens, types, [m if isinstance(m, str) else " ".join(m) for m in merges]


def _interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from rotate-half order [x_0..x_{d/2-1}, y_0..] to llama.cpp's pairs [x_0, y_0, x_1, ..]."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(layout, config: dict, sd: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """{GGUF name: float32 array} of the layout's weights, named by gguf's own table of each architecture."""
    arch = gguf.MODEL_ARCH.LLADA if layout.name == "llada" else gguf.MODEL_ARCH.DREAM
    layers = config["n_layers"] if layout.name == "llada" else config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, layers)
    heads = config.get("n_heads", config.get("num_attention_heads"))
    groups = config.get("n_kv_heads", config.get("num_key_value_heads"))
    out = {}
    for key, w in sd.items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConversionError(f"{key}: no GGUF name in the {layout.name} architecture")
        if layout.name == "llada" and key.endswith(("q_proj.weight", "k_proj.weight")):
            w = _interleave(w, heads if "q_proj" in key else groups)
        out[name] = w.float().numpy()
    return out


def write_gguf(folder: Path, layout, config: dict, sd: dict[str, torch.Tensor], path: Path, name: str = "") -> dict:
    """Write the GGUF file of the layout in `folder` (its config, weights `sd` and tokenizer) to `path` (`name`:
    its general.name, default the layout's), read it back, and return what the export's marker records of it."""
    arch = layout.name
    pre = pre_tokenizer(folder)
    tensors = gguf_tensors(layout, config, sd)
    vocab = config["vocab_size"]
    tokens, types, merges = tokenizer_vocab(folder, vocab)
    llada = arch == "llada"
    hidden = config["d_model"] if llada else config["hidden_size"]
    heads = config["n_heads"] if llada else config["num_attention_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name or arch)
    w.add_size_label(gguf.size_label(sum(a.size for a in tensors.values()), 0, 0, 0))
    w.add_block_count(config["n_layers"] if llada else config["num_hidden_layers"])
    w.add_context_length(config["max_sequence_length"] if llada else config["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(config["mlp_hidden_size"] if llada else config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(config["n_kv_heads"] if llada else config["num_key_value_heads"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if llada:
        w.add_vocab_size(vocab)
        w.add_rope_dimension_count(hidden // heads)
    w.add_causal_attention(False)
    if llada:
        w.add_diffusion_shift_logits(False)  # LLaDA predicts each position itself; Dream: the CLI's default shift
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(config["eos_token_id"])
    w.add_pad_token_id(config["pad_token_id"])
    w.add_mask_token_id(config["mask_token_id"])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_chat_template(chat_template(folder))
    if llada:
        # llama.cpp's LLaDA conversion turns BOS on (LLaDA's tokenizer starts prompts with one); ours starts
        # none (documents are separated by EOS), so the prompt's tokens are those `difflm generate` runs on
        w.add_add_bos_token(False)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"gguf": {"file": path.name, "architecture": arch, "pre_tokenizer": pre, **check_gguf(path, tensors)}}


def check_gguf(path: Path, expected: dict[str, np.ndarray]) -> dict:
    """Read `path` back (`gguf.GGUFReader`) and compare every tensor with what was meant to be written:
    ConversionError when a name, shape or value differs; else the figures the marker records."""
    reader = gguf.GGUFReader(str(path))
    got = {t.name: np.asarray(t.data).reshape(tuple(reversed([int(n) for n in t.shape]))) for t in reader.tensors}
    if set(got) != set(expected):
        raise ConversionError(f"{path}: tensors {sorted(set(got) ^ set(expected))} differ from the layout's")
    worst = 0.0
    for name, want in expected.items():
        if got[name].shape != want.shape:
            raise ConversionError(f"{path}: {name} reads back as {got[name].shape}, written {want.shape}")
        worst = max(worst, float(np.abs(got[name].astype(np.float64) - want).max(initial=0.0)))
    if worst != 0.0:
        raise ConversionError(f"{path}: the tensors read back differ from the layout's by up to {worst:.2e}")
    return {"tensors": len(got), "readback_max_abs_diff": worst}
