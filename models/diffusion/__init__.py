"""The diffusion mathematics in pure torch: it may import torch only (no megatron, transformers, prefect, mlflow).

Shared by megatron training, evaluation and the exported Hugging Face model: every module here is copied
into each export folder, so modules import each other only relatively (``from .noise import ...``).

The names below are imported on first use (`__getattr__`), not with the package: the architecture record (`arch`,
pure Python) is read by the config, and `difflm --help` must not wait for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers; at run time `__getattr__` imports each from its module
    from .bounds import LogitsFn, ar_nll_per_token, elbo_nll_per_token, perplexity
    from .conditional import (
        conditional_ar_nll,
        conditional_masked_nll,
        masked_greedy_match,
        rolling_windows,
    )
    from .documents import anneal_ratio, annealed_attention_mask, document_attention_mask, document_ids
    from .noise import mask_exactly, mask_tokens, sample_t, stratified_t, uniform_corrupt
    from .objectives import (
        cart_weights,
        loss_weights,
        masked_diffusion_loss,
        masked_diffusion_loss_terms,
        shift_targets,
        token_cross_entropy,
        x0_cross_entropy_terms,
    )
    from .samplers import MaskedSampler, block_spans, sample_masked_diffusion, sample_uniform_diffusion, unmask_schedule
    from .time_embedding import AdaLNorm, TimeEmbedding, timestep_features

# the modules the names of __all__ come from (each imports torch)
_SOURCES = ("bounds", "conditional", "documents", "noise", "objectives", "samplers", "time_embedding")

__all__ = [
    "anneal_ratio",
    "annealed_attention_mask",
    "MaskedSampler",
    "block_spans",
    "conditional_ar_nll",
    "conditional_masked_nll",
    "masked_greedy_match",
    "rolling_windows",
    "AdaLNorm",
    "LogitsFn",
    "TimeEmbedding",
    "ar_nll_per_token",
    "document_attention_mask",
    "document_ids",
    "elbo_nll_per_token",
    "loss_weights",
    "cart_weights",
    "mask_exactly",
    "mask_tokens",
    "masked_diffusion_loss",
    "perplexity",
    "sample_masked_diffusion",
    "sample_t",
    "sample_uniform_diffusion",
    "shift_targets",
    "stratified_t",
    "timestep_features",
    "token_cross_entropy",
    "uniform_corrupt",
    "unmask_schedule",
    "masked_diffusion_loss_terms",
    "x0_cross_entropy_terms",
]


def __getattr__(name: str) -> Any:
    """A name of __all__ (or one of the modules), imported from its module on first use and kept here."""
    if name in _SOURCES:
        return importlib.import_module(f".{name}", __name__)
    if name in __all__:
        for source in _SOURCES:
            module = importlib.import_module(f".{source}", __name__)
            if hasattr(module, name):
                globals()[name] = value = getattr(module, name)
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
