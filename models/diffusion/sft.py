"""Instruction data (supervised fine-tuning): which tokens of a packed window are response tokens, and the EOS
policy.

Pure torch, shipped in every export folder like the modules beside it. Instruction data carries a per-token mask
beside its tokens (1: an assistant response token, the EOS that closes the response included; 0: system and
user turns, template tokens). Every objective reads it the same way (`Objective.response_view`, then its
`prepare` with `response=`): the prompt stays clean and is never scored, noise and loss touch response tokens
only, and the loss is normalised over the response tokens (LLaDA's SFT, its conditional ELBO; SDAR, Fast-dLLM v2
and AR SFT alike).

The EOS policy (`diffusion.sft_eos`, a setting of every mode):
- `turn` (default): the tokens as data prep packed them; the EOS that ends each response is a response token,
  so it is noised and scored like the answer: the model learns to close its answer with EOS. Nothing is padded
  (packed windows have no tail to pad).
- `fill` (LLaDA's SFT: "pad |EOS| tokens to the end ... treat them as part of the response"): in each window
  the positions after its last response EOS become EOS and are scored as response, so the model learns to fill
  a generation window with EOS after its answer. The rest of the window (the start of the next conversation,
  cut by the window) is dropped. The filled EOS run belongs to the conversation it follows
  (`documents.document_ids`: a run of EOS ends one document).
"""

from __future__ import annotations

from typing import Literal

import torch

SftEos = Literal["turn", "fill"]


def response_view(batch: dict, eos_id: int | None, eos_policy: SftEos = "turn") -> dict:
    """The micro-batch `batch` of instruction data as an objective trains on it under `eos_policy`.

    `batch` holds `tokens`, `labels`, `loss_mask` (megatron's: the label is data), `response` / `response_labels`
    [b, s] (the response tokens among tokens / labels) and optionally `documents` [b, s] (the conversation each
    token belongs to). The batch returned has `loss_mask` restricted to response labels and, with `fill`, the
    window's tail turned into scored EOS of the conversation before it; its other keys are kept."""
    out = dict(batch)
    out["response"], out["response_labels"] = batch["response"].bool(), batch["response_labels"].bool()
    out["loss_mask"] = batch["loss_mask"].bool()
    if eos_policy == "fill":
        if eos_id is None:
            raise ValueError("diffusion.sft_eos=fill pads with EOS: build the objective with the tokenizer's eos_id")
        _fill_with_eos(out, eos_id)
    elif eos_policy != "turn":
        raise ValueError(f"diffusion.sft_eos={eos_policy!r}: one of turn, fill")
    out["loss_mask"] = out["loss_mask"] & out["response_labels"]
    return out


def _fill_with_eos(batch: dict, eos_id: int) -> None:
    """LLaDA's EOS padding in a packed window: after the row's last response EOS every token is EOS, scored, in
    the document of that EOS (in place on `batch`'s keys)."""
    tokens, response = batch["tokens"], batch["response"]
    s = tokens.shape[1]
    ends = response & tokens.eq(eos_id)  # [b, s] the EOS that closes a response
    position = torch.arange(s, device=tokens.device)
    last = torch.where(ends, position, torch.full_like(position, -1)).amax(-1, keepdim=True)  # [b, 1]; -1: none
    tail = (position > last) & (last >= 0)  # [b, s] the tokens after it (a row without one is left as it is)
    label_tail = (position >= last) & (last >= 0)  # labels[i] is token i + 1: from the closing EOS's label on
    batch["tokens"] = torch.where(tail, torch.full_like(tokens, eos_id), tokens)
    batch["labels"] = torch.where(label_tail, torch.full_like(tokens, eos_id), batch["labels"])
    # the filled labels are data even where megatron padded the window's last label
    batch["loss_mask"] = batch["loss_mask"] | label_tail
    batch["response"], batch["response_labels"] = response | tail, batch["response_labels"] | label_tail
    if "documents" in batch:
        docs = batch["documents"]
        batch["documents"] = torch.where(tail, docs.gather(1, last.clamp(min=0)), docs)
