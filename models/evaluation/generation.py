"""Samples from an export: the configured sampler, prompts from the run's own held-out data."""

from __future__ import annotations

import re

from difflm.config import EvalConfig
from difflm.models.diffusion import MaskedSampler


def sampler_settings(e: EvalConfig, **override) -> MaskedSampler:
    """The sampler eval.sampler describes: its fields are MaskedSampler's own (the one place it is built)."""
    return MaskedSampler(**{**e.sampler.model_dump(), **override})


def default_prompts(docs: list[str], n: int, words: int) -> list[str]:
    """The first `words` words of the first n held-out documents that have more than that many."""
    out = []
    for text in docs:
        found = re.findall(r"\S+", text)
        if len(found) > words:
            out.append(" ".join(found[:words]))
        if len(out) == n:
            break
    return out


def generate_samples(scorer, e: EvalConfig, prompts: list[str]) -> list[dict]:
    """One sample per prompt (at most e.num_samples), each recording its full sampler settings."""
    if not prompts or e.num_samples == 0:
        return []
    return scorer.generate(prompts[: e.num_samples], e.sample_length, sampler_settings(e))
