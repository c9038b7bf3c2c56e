"""Likelihood of an exported model on held-out data: the ELBO bound (diffusion), the exact NLL (ar).

Runs on the Hugging Face export (pure torch), so it needs no process group and scores exactly what
users download. Validation sequences are consecutive seq_length windows of the held-out documents.

Like for like: every mode scores tokens 1..L-1 of each window given token 0 (an AR model cannot predict
token 0; the diffusion bounds keep it clean), so AR and diffusion numbers cover the same tokens. A model
trained with document attention is scored with the same attention, taken from the clean window's EOS
positions as in training: its bound is on p(tokens | where the documents end), not on the raw stream.

Instruction data (`DataManifest.loss_masks`) is scored as it trains: on the response tokens of each window only,
given the rest (the conditional bound of the responses), each conversation one document (`instruction_windows`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from difflm.config import PipelineConfig
from difflm.manifest import DataManifest, loss_mask_prefix
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
    stream = _valid_stream(manifest, lambda p: p)
    n = min(max_sequences, len(stream) // seq_length)
    if n == 0:
        raise ValueError(f"validation split has {len(stream)} tokens, fewer than one sequence of {seq_length}")
    return torch.from_numpy(stream[: n * seq_length].reshape(n, seq_length))


def instruction_windows(manifest: DataManifest, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(scored, documents) [n, s] of `validation_windows`' windows of instruction data: the response tokens (the
    loss mask beside the shards) and each token's conversation; None for pretraining data."""
    if not manifest.loss_masks:
        return None
    n, s = windows.shape
    mask = _valid_stream(manifest, loss_mask_prefix)[: n * s].reshape(n, s)
    starts = _valid_stream(manifest, lambda p: p, starts=True)[: n * s].reshape(n, s)
    starts[:, 0] = 0
    return torch.from_numpy(mask == 1), torch.from_numpy(starts).cumsum(-1)


def _valid_stream(manifest: DataManifest, prefix, starts: bool = False) -> np.ndarray:
    """The held-out split's documents end to end (shards `prefix(p)`), or with `starts` 1 where a document starts."""
    # megatron-core only to read prepared shards: scoring an export loads without it
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    chunks = []
    for p in manifest.split("valid").prefixes:
        ds = IndexedDataset(prefix(p))
        for i in range(len(ds)):
            doc = np.asarray(ds[i], dtype=np.int64)
            chunks.append(np.eye(1, len(doc), dtype=np.int64)[0] if starts else doc)
    return np.concatenate(chunks)


@torch.no_grad()
def likelihood_bound(
    model,
    windows: torch.Tensor,
    cfg: PipelineConfig,
    batch_size: int = 8,
    progress: Progress | None = None,
    tokenizer=None,
    instruction: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> EvalResult:
    """NLL per token of the held-out windows: an upper bound (ELBO) for diffusion modes, exact for ar, with its
    standard error over the windows, and in bits per byte when `tokenizer` is given (the scored tokens decoded).
    The windows go to the model's device a batch at a time; the noise comes from a CPU generator, so the
    bound is the same number on every device (up to the model's arithmetic). `instruction`: (scored, documents)
    [n, s] of instruction data (`instruction_windows`): only the response tokens are scored, given the rest."""
    gen = torch.Generator(device="cpu").manual_seed(cfg.eval.seed)
    device = next(model.parameters()).device
    kind = "exact" if model.objective.exact else "elbo"  # the export's objective, not the config's
    nlls = []
    if progress is not None:
        progress.expect(len(windows))
    for i in range(0, len(windows), batch_size):  # the same tokens for every family: 1.. given token 0
        x0 = windows[i : i + batch_size].to(device)
        extra = {}
        if instruction is not None:  # the responses given their prompts, each conversation one document
            extra = {"scored": instruction[0][i : i + batch_size], "document_ids": instruction[1][i : i + batch_size]}
        nlls.append(
            model.nll_per_token(
                x0,
                t_samples=cfg.eval.t_samples,
                generator=gen,
                prefix_len=1,
                eps=getattr(cfg.diffusion, "eps", None),
                **extra,
            )
        )
        if progress is not None:
            progress(len(x0))
    per_window = torch.cat(nlls).double().cpu()
    scored = torch.ones_like(windows, dtype=torch.bool) if instruction is None else instruction[0].clone()
    scored[:, 0] = False  # tokens 1.. of each window
    if instruction is not None:  # a window without a response token has no per-token value (NaN): left out
        kept = ~per_window.isnan()
        per_window, windows, scored = per_window[kept], windows[kept], scored[kept]
        if not len(per_window):
            raise ValueError("the held-out windows hold no response token: check the instruction data's loss masks")
    nll = float(per_window.mean())
    se = float(per_window.std() / math.sqrt(len(per_window))) if len(per_window) > 1 else None
    n_bytes = scored_bytes(windows, tokenizer, scored) if tokenizer is not None else 0
    tokens = int(scored.sum())
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
        **({} if instruction is None else {"scored": "the response tokens of each window, given the rest"}),
    )


def scored_bytes(windows: torch.Tensor, tokenizer, scored: torch.Tensor | None = None) -> int:
    """UTF-8 bytes of the scored tokens (1.. of each window, or the `scored` ones) as text, special tokens dropped."""
    rows = (w[1:] for w in windows) if scored is None else (w[m] for w, m in zip(windows, scored))
    return sum(len(tokenizer.decode(r.tolist(), skip_special_tokens=True).encode()) for r in rows)
