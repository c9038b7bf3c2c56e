"""Samples from an exported model: diffusion generation after each prompt (greedy decoding for ar)."""

from __future__ import annotations

import torch

from difflm.config import PipelineConfig

DEFAULT_PROMPTS = ["The history of", "In mathematics, a", "The city is located", "During the war,"]


@torch.no_grad()
def generate_samples(model, tokenizer, cfg: PipelineConfig, prompts: list[str]) -> list[dict]:
    """Diffusion samples (iterative unmasking) continuing each prompt; ar models decode greedily."""
    gen = torch.Generator().manual_seed(cfg.eval.seed)
    e = cfg.eval
    out = []
    for prompt in prompts[: e.num_samples]:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)], dtype=torch.long)
        if cfg.diffusion.model_running_mode == "ar":
            seq = _greedy_ar(model, ids, e.sample_length)
        else:
            seq = model.diffusion_generate(ids, e.sample_length, e.sampler_steps, e.temperature, gen,
                                           forbidden_ids=(model.config.pad_token_id,))
        text = tokenizer.decode(seq[0, ids.shape[1]:].tolist(), skip_special_tokens=False)
        out.append({"prompt": prompt, "completion": text, "steps": e.sampler_steps})
    return out


def _greedy_ar(model, ids: torch.Tensor, length: int) -> torch.Tensor:
    for _ in range(length):
        nxt = model(ids).logits[:, -1, : model.config.real_vocab_size].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids

