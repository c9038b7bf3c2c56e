"""Tiny random stock transformers checkpoints (Llama, Qwen2, Qwen3, Mistral, Gemma) with a tokenizer, built in the test."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

VOCAB = 96  # tokens of the tiny tokenizer, = the checkpoints' embedding rows
KINDS = {  # name -> (model_type, config fields): MHA and GQA, tied and untied, bias, qk-norm, head_dim apart
    "llama-mha-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama-gqa-untied": ("llama", {"num_key_value_heads": 2, "tie_word_embeddings": False, "rope_theta": 500000.0}),
    "qwen2-bias": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "qwen3-qknorm-hd": ("qwen3", {"num_key_value_heads": 2, "head_dim": 12, "tie_word_embeddings": False}),
    "mistral": ("mistral", {"num_key_value_heads": 1, "tie_word_embeddings": False, "sliding_window": None}),
    # GELU-tanh gated MLP, (1 + w) RMSNorm, embeddings x sqrt(hidden), a head width apart from hidden / heads
    "gemma-hd": ("gemma", {"num_key_value_heads": 1, "head_dim": 12, "tie_word_embeddings": True}),
}


def tiny_tokenizer(folder: Path, vocab: int = VOCAB, reserved: str | None = None) -> None:
    """A word-level tokenizer of `vocab` tokens (EOS `</s>`); `reserved` names its last token (a spare id)."""
    # here, not at the top: tokenizers' `models` would shadow this project's `models` package in the module
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    if reserved:
        words = {**{w: i for w, i in words.items() if i != vocab - 1}, reserved: vocab - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(str(folder))


def tiny_stock(kind: str, folder: Path, seed: int = 0, reserved: str | None = None, **save) -> Path:
    """A random stock model of `kind` (KINDS) saved with its tokenizer into `folder`; norms and biases moved off
    their ones/zeros init so a mapping that swaps or drops them shows in the logits."""
    model_type, extra = KINDS[kind]
    extra = dict(extra)
    theta = extra.pop("rope_theta", 10000.0)
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        eos_token_id=1,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(folder), **save)
    tiny_tokenizer(folder, reserved=reserved)
    return folder
