"""Likelihood of an exported model on held-out data: the ELBO bound (diffusion), the exact NLL (ar).

Runs on the Hugging Face export (pure torch), so it needs no process group and scores exactly what
users download. Validation sequences are consecutive seq_length windows of the held-out documents.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from difflm.config import PipelineConfig
from models import diffusion


# What the validation number of each kind is, for logs and the CLI summary.
KIND_LABELS = {
    "elbo": "perplexity upper bound (diffusion ELBO)",
    "exact": "perplexity",
    "denoising_ce": "exp(denoising cross-entropy), not a likelihood",
}


@dataclass
class EvalResult:
    nll_per_token: float  # nats; an upper bound for diffusion models, exact for ar
    ppl: float  # exp(nll): a perplexity upper bound for diffusion models
    bits_per_token: float
    sequences: int
    tokens: int
    bound: bool  # True: ELBO bound (masked diffusion); False: exact likelihood (ar) or not a likelihood
    kind: str  # "elbo", "exact" (ar) or "denoising_ce" (uniform noise: x0-prediction CE, not a bound)

    def to_dict(self) -> dict:
        return asdict(self)


def validation_windows(manifest: dict, seq_length: int, max_sequences: int) -> torch.Tensor:
    """[n, seq_length] windows over the held-out split, in document order."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    chunks = []
    for prefix in manifest["splits"]["valid"]["prefixes"]:
        ds = IndexedDataset(prefix)
        chunks.extend(np.asarray(ds[i], dtype=np.int64) for i in range(len(ds)))
    stream = np.concatenate(chunks)
    n = min(max_sequences, len(stream) // seq_length)
    if n == 0:
        raise ValueError(f"validation split has {len(stream)} tokens, fewer than one sequence of {seq_length}")
    return torch.from_numpy(stream[: n * seq_length].reshape(n, seq_length))


@torch.no_grad()
def likelihood_bound(model, windows: torch.Tensor, cfg: PipelineConfig, batch_size: int = 8) -> EvalResult:
    gen = torch.Generator().manual_seed(cfg.eval.seed)
    mode = cfg.diffusion.model_running_mode
    kind = {"ar": "exact", "difflm-noshift-uniform": "denoising_ce"}.get(mode, "elbo")
    nlls = []
    for i in range(0, len(windows), batch_size):
        x0 = windows[i : i + batch_size]
        if kind == "exact":
            nlls.append(diffusion.ar_nll_per_token(lambda x: model(x).logits, x0))
        elif kind == "denoising_ce":
            nlls.append(_denoising_ce(model, x0, cfg.eval.t_samples, gen))
        else:
            nlls.append(diffusion.elbo_nll_per_token(model._logits, x0, model.config.mask_token_id,
                                                     cfg.eval.t_samples, gen))
    nll = float(torch.cat(nlls).mean())
    return EvalResult(
        nll_per_token=nll,
        ppl=diffusion.perplexity(nll),
        bits_per_token=nll / math.log(2),
        sequences=len(windows),
        tokens=int(windows.numel()),
        bound=kind == "elbo",
        kind=kind,
    )


def _denoising_ce(model, x0: torch.Tensor, t_samples: int, gen: torch.Generator) -> torch.Tensor:
    """Uniform-noise models: x0-prediction cross-entropy at stratified noise levels. [b]"""
    allowed = model._allowed_ids()
    total = torch.zeros(x0.shape[0])
    for k in range(t_samples):
        t = (k + torch.rand(x0.shape[0], generator=gen)) / t_samples
        xt, _ = diffusion.uniform_corrupt(x0, t, allowed, gen)
        total += diffusion.token_cross_entropy(model(xt).logits, x0).mean(-1)
    return total / t_samples
