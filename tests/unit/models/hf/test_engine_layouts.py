"""LLaDA's and Dream's layouts and the GGUF file, on random exported-model weights (no megatron here: the
checkpoint's exports, with parity against megatron, are tests/integration/test_engine_exports.py).

The layouts' reference forward (`layout_logits`) is written from their published description, apart from our
model code: it must compute our model's logits from the layout's weights, and a wrong mapping must show."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from helpers import tiny_config, tiny_hf_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from difflm.config import ConfigError
from difflm.models.hf import engines
from difflm.models.hf.convert import ConversionError
from difflm.models.hf.gguf_file import GGUF_FILE, check_gguf, pre_tokenizer, write_gguf

TOKENS = {"vocab_size": 300, "mask_id": 1, "eos_id": 0, "pad_id": 2}
SHAPE = ("model.hidden_size=32", "model.num_layers=2", "model.num_attention_heads=2", "model.ffn_hidden_size=64")


def _cfg(tmp_path, mode: str, *over: str):
    return tiny_config(tmp_path, *SHAPE, f"diffusion.model_running_mode={mode}", *over)


def _ours(mode: str, groups: int, tied: bool) -> dict[str, torch.Tensor]:
    """Our exported model's weights (the layout `to_hf_state_dict` gives), norms moved off their ones."""
    model = tiny_hf_model(mode, vocab=TOKENS["vocab_size"], num_key_value_heads=groups, tie_word_embeddings=tied)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model, {k: v.detach() for k, v in model.state_dict().items()}


CASES = [  # (mode, layout, query groups, tied): MHA and GQA, tied and untied, in both layouts
    ("difflm-noshift", "llada", 1, True),
    ("difflm-noshift", "llada", 2, False),
    ("difflm-shift", "dream", 1, False),
    ("difflm-shift", "dream", 2, True),
]


@pytest.mark.parametrize("mode, name, groups, tied", CASES)
def test_llada_and_dream_layouts_compute_our_model(tmp_path, mode, name, groups, tied):
    cfg = _cfg(tmp_path, mode, f"model.num_query_groups={groups}", f"model.tie_embeddings={str(tied).lower()}")
    layout = engines.layout_for(cfg, "gguf")
    assert layout.name == name
    model, ours = _ours(mode, groups, tied)
    sd = engines.layout_weights(layout, ours, cfg, TOKENS["vocab_size"])
    config = engines.layout_config(layout, cfg, TOKENS)
    ids = torch.randint(0, TOKENS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits  # raw: the shifted model's logit i is token i + 1's, Dream's too
    got = engines.layout_logits(layout, config, sd, ids)
    assert engines.parity(want, got.float(), TOKENS["vocab_size"], "test") < 1e-5
    if name == "dream":  # a Llama's Q/K/V without biases: written as zero biases (Qwen2's names)
        assert not sd["model.layers.0.self_attn.q_proj.bias"].any()
        assert ("lm_head.weight" in sd) != tied
        assert config["architectures"] == ["DreamModel"] and config["mask_token_id"] == 1
    else:
        assert ("model.transformer.ff_out.weight" in sd) != tied
        assert config["architectures"] == ["LLaDAModelLM"] and config["weight_tying"] == tied
        assert (config["d_model"], config["n_heads"], config["n_kv_heads"], config["mlp_hidden_size"]) == (
            32,
            2,
            groups,
            64,
        )
    # a mapping that swaps gate and up computes another function: the check refuses it
    gate, up = ("ff_proj", "up_proj") if name == "llada" else ("mlp.gate_proj", "mlp.up_proj")
    key = next(k for k in sd if k.endswith(f"{gate}.weight"))
    broken = {**sd, key: sd[key.replace(gate, up)], key.replace(gate, up): sd[key]}
    with pytest.raises(ConversionError, match="differ from the source's"):
        engines.parity(want, engines.layout_logits(layout, config, broken, ids).float(), TOKENS["vocab_size"], "x")


@pytest.mark.parametrize(
    "mode, fmt, over, says",
    [
        (
            "difflm-block",
            "gguf",
            (),
            "no engine layout holds difflm-block models yet; gguf takes llada (difflm-noshift), "
            "dream (difflm-shift): export it in difflm's own layout",
        ),
        ("difflm-noshift-uniform", "llada", (), "no engine layout holds difflm-noshift-uniform models yet"),
        ("ar", "dream", (), "export it as the stock transformers class instead (hf-stock"),
        (
            "difflm-shift",
            "llada",
            (),
            "--format llada holds difflm-noshift models, this one is difflm-shift: use --format dream",
        ),
        (
            "difflm-noshift",
            "dream",
            (),
            "--format dream holds difflm-shift models, this one is difflm-noshift: use --format llada",
        ),
        (
            "difflm-noshift",
            "gguf",
            ("model.qk_layernorm=true",),
            "are not those of llama; export it with --format difflm",
        ),
        ("difflm-shift", "dream", ("model.normalization=LayerNorm",), "not those of llama or qwen2"),
        ("difflm-noshift", "llada", ("model.qkv_bias=true",), "LLaDAModelLM layout cannot hold"),
        ("difflm-noshift", "llada", ("diffusion.time_embedding=true",), "conditions on the noise level t"),
        ("difflm-noshift", "gguf", ("model.kv_channels=8",), "head width"),
    ],
)
def test_a_model_no_layout_holds_is_refused_in_one_line(tmp_path, mode, fmt, over, says):
    try:
        cfg = _cfg(tmp_path, mode, *over)
    except ConfigError as err:  # a switch this backend cannot build: not this test's case
        pytest.fail(f"{over}: {err}")
    with pytest.raises(ConversionError) as err:
        engines.layout_for(cfg, fmt)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_config_refuses_an_engine_format_the_mode_has_none_of(tmp_path):
    with pytest.raises(ConfigError, match="export.formats: dream cannot hold a difflm-noshift model"):
        _cfg(tmp_path, "difflm-noshift", "export.formats=[dream]")
    assert _cfg(tmp_path, "difflm-shift", "export.formats=[dream,gguf]").export.formats == ["dream", "gguf"]


def _bpe(folder, pre) -> None:
    """A byte-level BPE of TOKENS' size (ids 0 eos, 1 mask, 2 pad: our data prep's order) saved into `folder`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENS["vocab_size"],
        special_tokens=["<|endoftext|>", "<|mask|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the cat sat on the mat 1234 times", "a dog ran 56 laps"] * 20, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", mask_token="<|mask|>", pad_token="<|pad|>"
    ).save_pretrained(str(folder))


def test_gguf_file_holds_the_llada_layout_with_its_tokenizer(tmp_path):
    cfg = _cfg(tmp_path, "difflm-noshift", "model.num_query_groups=1", "model.tie_embeddings=false")
    layout = engines.layout_for(cfg, "gguf")
    _, ours = _ours("difflm-noshift", 1, False)
    sd = engines.layout_weights(layout, ours, cfg, TOKENS["vocab_size"])
    config = engines.layout_config(layout, cfg, TOKENS)
    tok_dir, folder = tmp_path / "tok", tmp_path / "layout"
    _bpe(tok_dir, pre_tokenizers.ByteLevel(add_prefix_space=False))
    folder.mkdir()
    engines.write_layout(folder, sd, config, tok_dir, {**TOKENS, "path": str(tok_dir)})
    assert json.loads((folder / "tokenizer_config.json").read_text())["mask_token"] == "<|mask|>"
    record = write_gguf(folder, layout, config, sd, folder / GGUF_FILE)["gguf"]
    assert record == {
        "file": GGUF_FILE,
        "architecture": "llada",
        "pre_tokenizer": "gpt-2",
        "tensors": 2 + 1 + 9 * 2,
        "readback_max_abs_diff": 0.0,
    }
    reader = gguf.GGUFReader(str(folder / GGUF_FILE))
    kv = {k: f.contents() for k, f in reader.fields.items()}
    assert kv["general.architecture"] == "llada" and kv["llada.attention.causal"] is False
    assert kv["diffusion.shift_logits"] is False and kv["tokenizer.ggml.mask_token_id"] == 1
    assert kv["tokenizer.ggml.pre"] == "gpt-2" and kv["tokenizer.ggml.tokens"][:3] == [
        "<|endoftext|>",
        "<|mask|>",
        "<|pad|>",
    ]
    assert (kv["llada.embedding_length"], kv["llada.attention.head_count_kv"], kv["llada.vocab_size"]) == (32, 1, 300)
    # Q (and K) rows go to llama.cpp's interleaved RoPE order: each head's halves zipped
    q = {t.name: np.asarray(t.data) for t in reader.tensors}["blk.0.attn_q.weight"]
    layout_q = sd["model.transformer.blocks.0.q_proj.weight"].numpy()
    assert np.array_equal(q[0], layout_q[0]) and np.array_equal(q[1], layout_q[8])  # head width 16: 0, 8, 1, 9...
    # a file whose tensors differ from what was meant is refused on reading back
    with pytest.raises(ConversionError, match="differ from the layout's"):
        check_gguf(folder / GGUF_FILE, {"blk.0.attn_q.weight": q + 1.0})


def test_the_pre_tokenizer_is_named_from_the_tokenizer(tmp_path):
    _bpe(tmp_path / "ours", pre_tokenizers.ByteLevel(add_prefix_space=False))
    assert pre_tokenizer(tmp_path / "ours") == "gpt-2"
    digits = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    _bpe(tmp_path / "smollm", digits)
    assert pre_tokenizer(tmp_path / "smollm") == "smollm"
    _bpe(tmp_path / "other", pre_tokenizers.Metaspace())
    with pytest.raises(ConversionError, match="convert that folder with llama.cpp's convert_hf_to_gguf.py"):
        pre_tokenizer(tmp_path / "other")
