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
    # how far to trust it: the standard error of the mean over windows (the windows' spread and, for diffusion,
    # the Monte-Carlo noise of the bound together), the noise draws per window and the seed they came from
    stderr: float | None = None
    mc_samples: int | None = None  # t draws per window (eval.t_samples); None for the exact ar likelihood
    seed: int | None = None
    bits_per_byte: float | None = None  # the same nats over the UTF-8 bytes of the scored text
    stderr_bits_per_byte: float | None = None

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
    model,
    windows: torch.Tensor,
    cfg: PipelineConfig,
    batch_size: int = 8,
    progress: Progress | None = None,
    tokenizer=None,
) -> EvalResult:
    """NLL per token of the held-out windows: an upper bound (ELBO) for diffusion modes, exact for ar, with its
    standard error over the windows, and in bits per byte when `tokenizer` is given (the scored tokens decoded).
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
    per_window = torch.cat(nlls).double().cpu()
    nll = float(per_window.mean())
    se = float(per_window.std() / math.sqrt(len(per_window))) if len(per_window) > 1 else None
    n_bytes = scored_bytes(windows, tokenizer) if tokenizer is not None else 0
    tokens = int(windows.shape[0] * (windows.shape[1] - 1))
    bpb = nll * tokens / math.log(2) / n_bytes if n_bytes else None
    return EvalResult(
        nll_per_token=nll,
        ppl=diffusion.perplexity(nll),
        bits_per_token=nll / math.log(2),
        sequences=len(windows),
        tokens=tokens,
        bound=kind == "elbo",
        kind=kind,
        stderr=se,
        mc_samples=None if kind == "exact" else cfg.eval.t_samples,
        seed=cfg.eval.seed,
        bits_per_byte=bpb,
        stderr_bits_per_byte=(se * tokens / math.log(2) / n_bytes) if (se is not None and n_bytes) else None,
    )


def scored_bytes(windows: torch.Tensor, tokenizer) -> int:
    """UTF-8 bytes of the scored tokens (1.. of each window) as text, special tokens dropped."""
    return sum(len(tokenizer.decode(w[1:].tolist(), skip_special_tokens=True).encode()) for w in windows)
