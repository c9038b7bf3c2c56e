"""Likelihood of an exported model on held-out data: the ELBO bound (diffusion), the exact NLL (ar).

Runs on the Hugging Face export (pure torch), so it needs no process group and scores exactly what
users download. Validation sequences are consecutive seq_length windows of the held-out documents.

Like for like: every mode scores tokens 1..L-1 of each window given token 0 (an AR model cannot predict
token 0; the diffusion bounds keep it clean), so AR and diffusion numbers cover the same tokens. A model
trained with document attention is scored with the same attention, taken from the clean window's EOS
positions as in training: its bound is on p(tokens | where the documents end), not on the raw stream.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from difflm.config import PipelineConfig
from difflm.manifest import DataManifest
from difflm.models import diffusion
from difflm.models.evaluation.progress import Progress

# What the validation number of each kind is, for logs and the CLI summary.
KIND_LABELS = {
    "elbo": "perplexity upper bound (diffusion ELBO)",
    "exact": "perplexity",
}


@dataclass
class EvalResult:
    nll_per_token: float  # nats; an upper bound for diffusion models, exact for ar
    ppl: float  # exp(nll): a perplexity upper bound for diffusion models
    bits_per_token: float
    sequences: int
    tokens: int
    bound: bool  # True: an ELBO (every diffusion mode); False: the exact likelihood (ar)
    kind: str  # "elbo" (masked: LLaDA's discrete form; uniform: UDLM's continuous-time ELBO) or "exact" (ar)
    scored: str = "tokens 1..L-1 of each window, given token 0"

    def to_dict(self) -> dict:
        return asdict(self)


def validation_windows(manifest: DataManifest, seq_length: int, max_sequences: int) -> torch.Tensor:
    """[n, seq_length] windows over the held-out split, in document order."""
    # megatron-core only to read prepared shards: scoring an export loads without it
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    chunks = []
    for prefix in manifest.split("valid").prefixes:
        ds = IndexedDataset(prefix)
        chunks.extend(np.asarray(ds[i], dtype=np.int64) for i in range(len(ds)))
    stream = np.concatenate(chunks)
    n = min(max_sequences, len(stream) // seq_length)
    if n == 0:
        raise ValueError(f"validation split has {len(stream)} tokens, fewer than one sequence of {seq_length}")
    return torch.from_numpy(stream[: n * seq_length].reshape(n, seq_length))


@torch.no_grad()
def likelihood_bound(
    model, windows: torch.Tensor, cfg: PipelineConfig, batch_size: int = 8, progress: Progress | None = None
) -> EvalResult:
    """NLL per token of the held-out windows: an upper bound (ELBO) for diffusion modes, exact for ar.
    The windows go to the model's device a batch at a time; the noise comes from a CPU generator, so the
    bound is the same number on every device (up to the model's arithmetic)."""
    gen = torch.Generator(device="cpu").manual_seed(cfg.eval.seed)
    device = next(model.parameters()).device
    kind = "exact" if model.objective.exact else "elbo"  # the export's objective, not the config's
    nlls = []
    if progress is not None:
        progress.expect(len(windows))
    for i in range(0, len(windows), batch_size):  # the same tokens for every family: 1.. given token 0
        x0 = windows[i : i + batch_size].to(device)
        nlls.append(
            model.nll_per_token(
                x0, t_samples=cfg.eval.t_samples, generator=gen, prefix_len=1, eps=getattr(cfg.diffusion, "eps", None)
            )
        )
        if progress is not None:
            progress(len(x0))
    nll = float(torch.cat(nlls).mean())
    return EvalResult(
        nll_per_token=nll,
        ppl=diffusion.perplexity(nll),
        bits_per_token=nll / math.log(2),
        sequences=len(windows),
        tokens=int(windows.shape[0] * (windows.shape[1] - 1)),
        bound=kind == "elbo",
        kind=kind,
    )
