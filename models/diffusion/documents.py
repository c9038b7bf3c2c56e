"""Packed documents: which document each position belongs to, and the attention mask that keeps them apart.

Pure torch; used by the megatron forward step (arbitrary mask) and the HF model (SDPA mask).
"""

from __future__ import annotations

import torch


def document_ids(x0: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Index of the packed document each position belongs to (an EOS ends its own document). [b, s]"""
    is_eos = (x0 == eos_id).long()
    return is_eos.cumsum(-1) - is_eos


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
