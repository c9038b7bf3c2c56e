"""Packed documents: which document each position belongs to, and the attention mask that keeps them apart.

Pure torch; used by the megatron forward step (arbitrary mask) and the HF model (SDPA mask).
"""

from __future__ import annotations

import torch


def document_ids(x0: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Index of the packed document each position belongs to (an EOS, or a run of EOS, ends its own document). [b, s]

    A run of EOS stays with the document it ends: instruction data's EOS fill (`sft.response_view`, LLaDA's
    padding) is the tail of its conversation, not one-token documents of its own."""
    is_eos = x0 == eos_id
    starts = torch.zeros_like(is_eos)
    starts[:, 1:] = is_eos[:, :-1] & ~is_eos[:, 1:]  # a document starts after the EOS that ended the one before
    return starts.long().cumsum(-1)


def document_attention_mask(doc_ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """[b, 1, s, s] bool, True where attention is BLOCKED (megatron's convention): across documents,
    and to the future when causal. Taken from the clean sequence, so a masked EOS still separates."""
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # [b, s(query), s(key)]
    if causal:
        s = doc_ids.shape[1]
        same = same & torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return ~same[:, None]


def document_pairs(doc_ids: torch.Tensor) -> int:
    """(query, key) pairs attention keeps with packed documents: the sum over rows and documents of the squared
    document lengths (the FLOPs count's attention core; s^2 per row without documents)."""
    _, counts = torch.unique_consecutive(
        doc_ids + doc_ids.new_tensor(range(len(doc_ids)))[:, None] * doc_ids.numel(), return_counts=True
    )
    return int((counts.long() ** 2).sum())


def anneal_ratio(step: int, anneal_steps: int) -> float:
    """The share of future keys a query sees at training step `step` (0-based) of DiffuLLaMA's attention-mask
    annealing over `anneal_steps`: step / anneal_steps, capped at 1 (0: exactly causal at step 0; 1: full from
    step `anneal_steps` on). DiffuLLaMA's `get_anneal_attn_mask` uses (step + 1) / anneal_steps, one step ahead."""
    return 1.0 if anneal_steps <= 0 else min(1.0, step / anneal_steps)


def annealed_attention_mask(
    step: int, anneal_steps: int, seq_length: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """[s, s] bool, True where attention is BLOCKED (megatron's convention), at training step `step`: causal
    attention OR a Bernoulli(anneal_ratio) draw per (query, key) pair (DiffuLLaMA, arXiv 2410.17891; its
    LLaMA-Factory trainer's `get_anneal_attn_mask`). Exactly causal at step 0, nothing blocked once the ratio is 1.
    A shorter sequence takes the top-left corner, so every micro-batch of a step shares one draw."""
    ratio = anneal_ratio(step, anneal_steps)
    causal = torch.ones(seq_length, seq_length, dtype=torch.bool).tril()
    if ratio >= 1.0:
        return torch.zeros(seq_length, seq_length, dtype=torch.bool)
    if ratio <= 0.0:
        return ~causal
    random = torch.rand(seq_length, seq_length, generator=generator) < ratio
    return ~(causal | random)
