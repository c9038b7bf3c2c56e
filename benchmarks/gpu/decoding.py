"""Decoding speed of an export, one sampler at a time: tokens/s, model calls per token, agreement with a baseline
row and (on CUDA) peak memory. Shared by `benchmarks/generate.py` (on text, the cloze items of a run's data) and
the GPU check's `decode` section (on token ids, benchmarks/gpu/decode.py).

Depends on torch, transformers and `models/` only (no data prep, no config tree, no megatron), so that it imports
in the bare GPU image.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from difflm.models.diffusion import MaskedSampler
from difflm.models.diffusion.modes import objective_class
from difflm.models.evaluation.efficiency import decode_counts
from difflm.models.evaluation.scoring import Scorer
from difflm.models.hf.configuration_difflm import DiffLMConfig
from difflm.models.hf.modeling_difflm import DiffLMForMaskedLM

BASELINE = "low-confidence, 1 token/step (baseline)"
AR = "autoregressive + KV cache (greedy)"

# SmolLM2-135M's shape (Llama: 30 layers, hidden 576, GQA 9/3, SwiGLU 1536, tied embeddings, vocabulary 49,152)
SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "rope_theta": 100000.0,
    "max_position_embeddings": 2048,
}


def samplers(n: int) -> dict[str, dict]:
    """name -> MaskedSampler fields of a full-sequence masked model's rows; the first is the baseline."""
    return {
        BASELINE: dict(steps=n),
        "low-confidence, 2 tokens/step": dict(steps=max(1, n // 2)),
        "low-confidence, 4 tokens/step": dict(steps=max(1, n // 4)),
        "blocks of 8, 1 token/step": dict(steps=n, block_length=8),
        "margin, 1 token/step": dict(steps=n, remasking="margin"),
        "entropy, 1 token/step": dict(steps=n, remasking="entropy"),
        "random, 1 token/step": dict(steps=n, remasking="random"),
        "threshold 0.9 (Fast-dLLM)": dict(threshold=0.9),
        "threshold 0.7 (Fast-dLLM)": dict(threshold=0.7),
        "threshold 0.9, blocks of 8": dict(threshold=0.9, block_length=8),
        # Fast-dLLM's prefix cache: each block's later steps skip the prompt and earlier blocks (approximate)
        "blocks of 8, 1 token/step + prefix cache": dict(steps=n, block_length=8, prefix_cache=True),
    }


def other_decoders(n: int) -> dict[str, dict]:
    """name -> MaskedSampler fields of the block-diffusion export's rows (its blocks come from the model)."""
    return {
        "block diffusion + KV cache, 1 token/step": dict(steps=n),
        "block diffusion + KV cache, threshold 0.9": dict(threshold=0.9),
        "block diffusion + KV cache, threshold 0.7": dict(threshold=0.7),
        "block diffusion, no KV cache, 1 token/step": dict(steps=n, kv_cache=False),
    }


class IdTokenizer:
    """Prompts and completions as space-separated token ids: the scorer's text interface on any vocabulary (a
    random model's, the check's synthetic corpus), with no tokenizer files."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def has_blocks(mode: str) -> bool:
    """Whether `mode` decodes block by block (its objective has a block size)."""
    return "block_size" in objective_class(mode).settings()


def random_model(shape: dict, mode: str, block_size: int | None = None, seed: int = 0) -> DiffLMForMaskedLM:
    """An export-shaped model of `shape` (DiffLMConfig fields) in `mode`, random weights (ids 0 eos, 1 mask, 2 pad):
    the cost of decoding at that size, whatever it outputs."""
    torch.manual_seed(seed)
    objective = {"mode": mode, **({"block_size": block_size} if has_blocks(mode) else {})}
    cfg = DiffLMConfig(
        **shape,
        bidirectional=objective_class(mode).bidirectional,
        objective=objective,
        mask_token_id=1,
        eos_token_id=0,
        pad_token_id=2,
        special_ids=[0, 1, 2],
    )
    return DiffLMForMaskedLM(cfg).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    scorer: Scorer, prompts: list[str], n: int, name: str, fields: dict, baseline: list[list[int]] | None = None
) -> tuple[dict, list[dict], list[list[int]]]:
    """(row, the scorer's records, the generated ids) of `n` new tokens after each prompt with the sampler
    `fields` (greedy, no stop at EOS), in batches of scorer.batch_size. `agreement`: the share of generated tokens
    equal to `baseline`'s (this row's own when None: 1.0)."""
    settings = replace(MaskedSampler(stop_at_eos=False), **fields)
    device = scorer.device
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    recs = scorer.generate(prompts, n, settings)
    _sync(device)
    seconds = time.perf_counter() - t0
    tokens = [scorer.tokenizer.encode(r["completion"], add_special_tokens=False) for r in recs]
    reference = tokens if baseline is None else baseline
    agree = sum(sum(a == b for a, b in zip(t, bt)) for t, bt in zip(tokens, reference))
    total = sum(max(len(bt), 1) for bt in reference)
    batch = scorer.batch_size
    n_batches = max(1, -(-len(prompts) // batch))
    calls = sum(r["model_calls"] or 0 for r in recs[::batch])  # one record per batch carries its calls
    row = {
        "sampler": name,
        "tokens_per_s": len(prompts) * n / seconds,
        "seconds": seconds,
        "batch_size": batch,
        "model_calls_per_batch": calls / n_batches,
        "model_calls_per_token": calls / n_batches / n,
        "agreement": agree / total,
        # the evaluation record's counters (efficiency.py): every forward a row rode, valid tokens up to EOS
        **decode_counts(recs),
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "settings": {**fields, **{k: v for k, v in recs[0]["sampler"].items() if k in ("block_size", "kv_cache")}},
    }
    return row, recs, tokens


def warm_up(scorer: Scorer, prompts: list[str], n: int) -> None:
    """One untimed batch (allocations, kernel choices), one token per step."""
    scorer.generate(prompts[: scorer.batch_size], n, MaskedSampler(steps=n, stop_at_eos=False))
