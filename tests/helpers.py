"""Helpers the test modules import. Fixtures live in conftest.py, which pytest loads as a plugin: a test module
that imported it as a module would load it a second time."""

from __future__ import annotations

from pathlib import Path

import torch

from difflm.config import PipelineConfig, load_config
from models.diffusion.modes import objective_class
from models.hf.configuration_difflm import DiffLMConfig
from models.hf.modeling_difflm import DiffLMForMaskedLM

# a four-step run that evaluates and checkpoints twice: the cluster launchers' tests train it
SHORT_RUN = [
    "train.train_iters=4",
    "train.warmup_iters=1",
    "checkpoint.save_interval=2",
    "train.eval_interval=2",
    "train.log_interval=2",
    "train.eval_iters=1",
]


def tiny_config(workdir: Path, *overrides: str) -> PipelineConfig:
    """The test-tiny preset with its outputs under `workdir`, and `section.field=value` overrides."""
    return load_config("test-tiny", [f"workdir={workdir}", *overrides])


def tiny_hf_model(mode: str = "difflm-noshift", seed: int = 0, vocab: int = 64, **over):
    """A two-layer exported-model instance (ids 0 eos, 1 mask, 2 pad), seeded, in eval mode; `over` sets the
    mode's settings (block_size, eps, ...: the config's objective entry) or any other DiffLMConfig field."""
    settings = {k: over.pop(k) for k in objective_class(mode).settings() if k in over}

    torch.manual_seed(seed)
    cfg = DiffLMConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        bidirectional=mode != "ar",
        objective={"mode": mode, **settings},
        mask_token_id=1,
        eos_token_id=0,
        pad_token_id=2,
        special_ids=[0, 1, 2],
        max_position_embeddings=64,
        **over,
    )
    return DiffLMForMaskedLM(cfg).eval()


class CharTokenizer:
    """A stand-in tokenizer for the scorer: one id per character (ids 3..42), decoded to letters."""

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 40 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def assert_same_weights(a, b, where: str = "") -> None:
    """Bit for bit: a resumed or requeued run against an uninterrupted one (nested dicts of tensors)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_weights(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
