"""Helpers the test modules import. Fixtures live in conftest.py, which pytest loads as a plugin: a test module
that imported it as a module would load it a second time."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from difflm.config import PipelineConfig, load_config
from difflm.manifest import DataManifest, SplitStats, TokenizerInfo
from difflm.models.diffusion.modes import build_objective, objective_class
from difflm.models.hf.configuration_difflm import DiffLMConfig
from difflm.models.hf.modeling_difflm import DiffLMForMaskedLM

ROOT = Path(__file__).resolve().parents[2]  # the repository

# a four-step run that evaluates and checkpoints twice: the cluster launchers' tests train it
SHORT_RUN = [
    "train.train_iters=4",
    "train.schedule.warmup_iters=1",
    "checkpoint.save_interval=2",
    "train.eval_interval=2",
    "train.log_interval=2",
    "train.eval_iters=1",
]


# The canonical short run of the shared trained runs (conftest.py `trained`): 16 steps at a rate that learns in them,
# a checkpoint every 4 (all kept), a log line a step, validation at steps 0, 8 and 16. Tests that only need "a trained
# run" of a mode read the shared one; a test that trains with exactly these settings elsewhere (the fault tests'
# interrupted runs) must end with its weights.
TRAINED = (
    "train.train_iters=16",
    "train.optimizer.lr=5e-3",
    "train.schedule.warmup_iters=2",
    "checkpoint.save_interval=4",
    "checkpoint.keep_last=10",
    "train.log_interval=1",
    "train.eval_interval=8",
)
TRAINED_MODES = {  # the shared runs: mode -> its settings on top of TRAINED
    "masked": ("diffusion.model_running_mode=difflm-noshift",),
    "ar": ("diffusion.model_running_mode=ar",),
    "block": ("diffusion.model_running_mode=difflm-block", "diffusion.block_size=8", "diffusion.varilen_prob=0.5"),
    # Dream's objective; untied, as masked-untied (tests/integration/test_llama_cpp.py): a tied tiny model's head scores
    # the mask's own embedding highest at masked positions early in training, and llama.cpp, which does not forbid the
    # mask token as our sampler does, keeps those positions masked; untied ones predict words there
    "shift": ("diffusion.model_running_mode=difflm-shift", "model.tie_embeddings=false"),
    "masked-untied": ("diffusion.model_running_mode=difflm-noshift", "model.tie_embeddings=false"),
}


def trained_overrides(mode: str) -> tuple[str, ...]:
    """The overrides of the shared trained run of `mode` (a key of TRAINED_MODES)."""
    return (*TRAINED, *TRAINED_MODES[mode])


def tiny_config(workdir: Path, *overrides: str) -> PipelineConfig:
    """The test-tiny preset with its outputs under `workdir`, and `section.field=value` overrides."""
    return load_config("test-tiny", [f"workdir={workdir}", *overrides])


def manifest_record(data_hash: str = "d" * 12, folder: str | Path = "/nonexistent/data", **changes) -> DataManifest:
    """A data manifest of made-up data (a 512-token tokenizer, ids 0..2 special; 40 train / 5 valid documents), for a
    test that needs the record and no data on disk; `changes` replace its fields."""
    tok = TokenizerInfo(str(Path(folder) / "tokenizer"), 512, eos_id=0, mask_id=1, pad_id=2, sha256="0" * 64)
    splits = {"train": _one_source(40, 4000), "valid": _one_source(5, 500), "test": _one_source(0, 0)}
    base = DataManifest(str(folder), data_hash, tok, splits, sources=({"name": "demo", "path": "demo.jsonl"},))
    return base.replace(**changes)


def _one_source(documents: int, tokens: int) -> SplitStats:
    return SplitStats(documents, tokens, sources={"demo": {"documents": documents, "tokens": tokens}})


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


class TinyBidirectional(torch.nn.Module):
    """Logits at i depend on the token at i, its position, and the mean of every embedding (bidirectional): a
    model small enough for exact conditional likelihoods by enumeration. Real tokens 0..4 (0 doubles as EOS),
    mask id 5."""

    VOCAB, MASK, EOS = 5, 5, 0

    def __init__(self, seed: int = 0, vocab: int = VOCAB + 1, dim: int = 8, seq: int = 16):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(vocab, dim, generator=g)
        self.pos = torch.randn(seq, dim, generator=g)
        self.mix = torch.randn(dim, dim, generator=g) / math.sqrt(dim)
        self.out = torch.randn(dim, vocab, generator=g) * 1.5

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        e = self.emb[x] + self.pos[: x.shape[1]]
        h = torch.tanh(e + e.mean(1, keepdim=True) @ self.mix)
        logits = h @ self.out
        logits[..., self.MASK] = -1e9  # a distribution over real tokens only
        return logits


HF_VOCAB = 64  # tiny_hf_model's vocabulary in the tests that share it


def timed_hf_model(mode: str = "difflm-noshift", **over):
    """`tiny_hf_model` (vocabulary HF_VOCAB) with trained-looking time conditioning."""
    model = tiny_hf_model(mode, 0, HF_VOCAB, **over)
    with torch.no_grad():  # trained (non-zero) time conditioning: t changes the output
        for name, p in model.named_parameters():
            if "linear_2.weight" in name:
                p.normal_(0, 0.5)
    return model


def block_megatron(tmp_path, backend: str, *over: str):
    """A test-tiny difflm-block megatron model (vocab 512, weights nudged off their init) and its config."""
    from difflm.models.megatron.gpt import build_model

    cfg = tiny_config(
        tmp_path,
        "diffusion.model_running_mode=difflm-block",
        "diffusion.block_size=4",
        f"model.backend={backend}",
        *over,
    )
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=512, objective=build_objective(cfg.diffusion)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return cfg, model


def save_megatron_checkpoint(model, path):
    """`model`'s weights as a megatron dist checkpoint at `path` (a new folder)."""
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(prefix="")}, str(path))


def fake_export(folder: Path) -> Path:
    """An HF-like folder whose safetensors header says 10*4 + 4 = 44 parameters (no tensor data needed)."""
    folder.mkdir(parents=True)
    header = json.dumps(
        {
            "w": {"dtype": "F32", "shape": [10, 4], "data_offsets": [0, 160]},
            "b": {"dtype": "F32", "shape": [4], "data_offsets": [160, 176]},
        }
    ).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(176))
    (folder / "config.json").write_text("{}")
    return folder
