"""Held-out instructions scored before and after instruction tuning (`difflm sft`).

The items come from the instruction data's own held-out split, at the token level: each held-out conversation's
tokens and its loss mask (`difflm.manifest.loss_mask_prefix`: 1 on the assistant's tokens, the EOS that ends each
turn included). Every run of scored tokens is one item: its response those tokens, its prompt every token of the
conversation before them (the chat template's tokens as data prep wrote them, so nothing is re-tokenized and a
multi-turn conversation gives one item per assistant turn, each with the turns before it).

Two scores per model, on the same items:
- `nll_per_token`: the conditional likelihood of the responses given their prompts, in nats per response token
  (`Scorer.loglikelihood_tokens`: exact for ar, the Monte-Carlo conditional ELBO, an upper bound, for diffusion
  modes: the SFT objective's own quantity);
- `exact_match`: the response generated from the prompt with the configured sampler (eval.sampler; as many new
  tokens as the longest response), cut at the first EOS, decoded, equal to the reference response once both are
  stripped (the seeded tasks have one exact answer each).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from difflm.config import EvalConfig
from difflm.errors import UserError
from difflm.manifest import DataManifest, loss_mask_prefix
from difflm.models.evaluation.generation import sampler_settings
from difflm.models.evaluation.scoring import Scorer
from difflm.models.evaluation.tasks import stderr_of_mean

SPLIT = "valid"  # the held-out split data prep writes


class NoInstructionItems(UserError, ValueError):
    """The data has no held-out instruction items (not instruction data, or no mask files beside its shards)."""


def instruction_items(manifest: DataManifest, limit: int) -> list[dict[str, list[int]]]:
    """Up to `limit` items {prompt, response} (token ids) from the held-out split, in order: one per run of scored
    tokens of each conversation. NoInstructionItems when the data is not instruction data."""
    # megatron-core only to read prepared shards (as tasks.heldout_documents)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if manifest.kind != "instruction":
        raise NoInstructionItems(
            f"the data at {manifest.dir} is {manifest.kind} data: held-out instructions need instruction data "
            "(data.kind=instruction)"
        )
    items: list[dict[str, list[int]]] = []
    for prefix in manifest.split(SPLIT).prefixes:
        masks = loss_mask_prefix(prefix)
        if not Path(masks + ".idx").is_file():
            raise NoInstructionItems(f"no loss mask beside {prefix} ({masks}.idx): prepare the data again")
        tokens, scored = IndexedDataset(prefix), IndexedDataset(masks)
        for i in range(len(tokens)):
            for item in _turns(np.asarray(tokens[i]).tolist(), np.asarray(scored[i]).tolist()):
                items.append(item)
                if len(items) >= limit:
                    return items
    return items


def _turns(ids: list[int], mask: list[int]) -> list[dict[str, list[int]]]:
    """Each run of mask 1 as {prompt: every token before it, response: its tokens}."""
    out, start = [], None
    for k, m in enumerate([*mask, 0]):
        if m and start is None:
            start = k
        elif not m and start is not None:
            if start > 0:  # a response with no prompt is no instruction
                out.append({"prompt": ids[:start], "response": ids[start:k]})
            start = None
    return out


def score_instructions(model, tokenizer, items: list[dict[str, list[int]]], e: EvalConfig) -> dict[str, Any]:
    """{nll_per_token, exact_match (+ stderr), items, response_tokens, samples} of `model` on `items`."""
    scorer = Scorer(model, tokenizer, mc_samples=e.mc_samples, seed=e.seed, greedy=False)
    assert scorer.max_length is not None  # the scorer sets it from the model
    scored = scorer.loglikelihood_tokens([(it["prompt"], it["response"]) for it in items])
    n_tokens = sum(len(it["response"]) for it in items)
    nll = -sum(ll for ll, _ in scored) / max(n_tokens, 1)
    answers = [_text(tokenizer, it["response"], scorer.eos) for it in items]
    new_tokens = min(max(len(it["response"]) for it in items), scorer.max_length - 1)
    records = scorer.generate(
        [tokenizer.decode(it["prompt"]) for it in items],
        new_tokens,
        sampler_settings(e),
        prompt_ids=[it["prompt"] for it in items],
    )
    hits = [float(r["completion"].strip() == a) for r, a in zip(records, answers)]
    samples = [
        {"prompt": r["prompt"][-200:], "target": a, "output": r["completion"], "exact": h}
        for r, a, h in zip(records, answers, hits)
    ]
    return {
        "nll_per_token": nll,
        "exact_match": sum(hits) / max(len(hits), 1),
        "exact_match_stderr": stderr_of_mean(hits),
        "items": len(items),
        "response_tokens": n_tokens,
        "new_tokens": new_tokens,
        "samples": samples,
    }


def _text(tokenizer, ids: list[int], eos: int) -> str:
    """The reference response as the generation is read: up to its EOS, special tokens dropped, stripped."""
    return tokenizer.decode(ids[: ids.index(eos)] if eos in ids else ids, skip_special_tokens=True).strip()


def before_after_lines(before: dict[str, Any] | None, after: dict[str, Any]) -> list[str]:
    """What `difflm sft` prints: held-out exact match and conditional NLL, before and after."""
    n = after["items"]
    if before is None:
        return [f"held-out exact match: after {after['exact_match']:.3f} ({n} items)"]
    return [
        f"held-out exact match: before {before['exact_match']:.3f}  after {after['exact_match']:.3f}  ({n} items)",
        f"held-out response NLL: before {before['nll_per_token']:.3f}  after {after['nll_per_token']:.3f} nats/token",
    ]
