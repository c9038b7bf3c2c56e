"""Conditional likelihood log p(continuation | context): the Monte-Carlo conditional ELBO for masked diffusion
(LLaDA's `get_log_likelihood` estimator), UDLM's bound for uniform noise, the exact value for ar; rolling
windows over long documents.

Pure torch. A sequence x0 [b, s] holds context and continuation; `target` [b, s] (bool) marks the
continuation, the positions scored. Context positions stay clean, so the value is conditional on them.
Every function returns the TOTAL nats of each row's continuation (float64, [b]), what lm-eval's
`loglikelihood` needs (negated), not a per-token mean.

Seeding: pass one generator per row (`generators`) to make each row's estimate independent of the rows
batched with it (a request scores the same whatever else is in the batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .noise import NOISE_DEVICE
from .objectives import token_cross_entropy

# (tokens [n, s], attention_mask [n, s] bool or None, document_ids [n, s] or None) -> logits [n, s, v], aligned
# with the positions they predict; the document ids are training's segmentation of those rows (None: one document)
PaddedLogitsFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]
Generators = torch.Generator | Sequence[torch.Generator | None] | None


def _per_row(generators, b: int) -> list:
    if isinstance(generators, (list, tuple)):
        if len(generators) != b:
            raise ValueError(f"{len(generators)} generators for {b} rows: pass one per row")
        return list(generators)
    return [generators] * b  # one shared generator (or None): rows draw in order


def stratified_mask_counts(length: int, samples: int, generator: torch.Generator | None) -> torch.Tensor:
    """`samples` mask counts l in 1..length, one per equal bin of (0, 1]: l = ceil((k + u) / n * L).

    Averaged over k, (k + u) / n is uniform, so l is uniform on {1..L}: the estimator stays unbiased while
    the bins spread the counts (lower variance than independent draws)."""
    u = torch.rand(samples, generator=generator, device=NOISE_DEVICE)
    v = (torch.arange(samples, device=NOISE_DEVICE) + u) / samples
    return (v * length).ceil().clamp(1, max(length, 1)).long()


@torch.no_grad()
def conditional_masked_nll(
    logits_fn: PaddedLogitsFn,
    x0: torch.Tensor,
    target: torch.Tensor,
    mask_id: int,
    mc_samples: int = 32,
    generators: Generators = None,
    attention_mask: torch.Tensor | None = None,
    max_rows: int = 64,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Upper bound (MC estimate) of -log p(continuation | context) in nats, per row [b] (float64).

    LLaDA's conditional ELBO: with L continuation tokens, -log p(c | ctx) <= E_{l ~ U{1..L}} E_{|M| = l}
    [(L / l) * sum_{i in M} -log p_theta(c_i | ctx, c outside M)], M drawn among the continuation only.
    `mc_samples` draws per row with l stratified; the b * mc_samples noised rows go through the model
    in batches of `max_rows`. Rows with an empty continuation score 0. The noised rows are built on the CPU
    with the noise and go to x0's device a batch at a time."""
    b, s = x0.shape
    cpu = NOISE_DEVICE
    gens = _per_row(generators, b)
    lengths = target.sum(-1).to(cpu)
    xs, masks, weights, owners = [], [], [], []
    for i in range(b):
        length = int(lengths[i])
        if length == 0:
            continue
        counts = stratified_mask_counts(length, mc_samples, gens[i])
        # draws over the continuation only: the estimate does not depend on padding or the batch
        chosen = torch.rand(mc_samples, length, generator=gens[i], device=cpu).argsort(-1).argsort(-1) < counts[:, None]
        masked = torch.zeros(mc_samples, s, dtype=torch.bool, device=cpu)
        masked[:, target[i].to(cpu)] = chosen
        xt = torch.where(masked, torch.full_like(masked, mask_id, dtype=x0.dtype), x0[i : i + 1].to(cpu))
        xs.append(xt)
        masks.append(masked)
        weights.append(length / counts.double())
        owners.append(torch.full((mc_samples,), i, device=cpu))
    total = torch.zeros(b, dtype=torch.float64, device=cpu)
    if not xs:
        return total
    xt, masked, weight, owner = torch.cat(xs), torch.cat(masks), torch.cat(weights), torch.cat(owners)
    dev = x0.device
    for a in range(0, len(xt), max_rows):
        sl = slice(a, a + max_rows)
        rows = owner[sl].to(dev)
        attn = None if attention_mask is None else attention_mask[rows]
        docs = None if document_ids is None else document_ids[rows]
        ce = token_cross_entropy(logits_fn(xt[sl].to(dev), attn, docs), x0[rows])
        per_row = (ce * masked[sl].to(dev)).sum(-1).double().to(cpu) * weight[sl]
        total.index_add_(0, owner[sl], per_row)
    return total / mc_samples


@torch.no_grad()
def conditional_ar_nll(
    logits_fn: PaddedLogitsFn,
    x0: torch.Tensor,
    target: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact -log p(continuation | context) of a causal model, per row [b] (float64). Position 0 has no
    logit, so a target there is an error (prepend a context token, e.g. EOS, as lm-eval does)."""
    if target[:, 0].any():
        raise ValueError("a causal model cannot score token 0: give every continuation at least one context token")
    ce = token_cross_entropy(logits_fn(x0, attention_mask, document_ids)[:, :-1], x0[:, 1:])
    return (ce * target[:, 1:]).sum(-1).double().cpu()


@torch.no_grad()
def masked_greedy_match(
    logits_fn: PaddedLogitsFn,
    x0: torch.Tensor,
    target: torch.Tensor,
    mask_id: int,
    attention_mask: torch.Tensor | None = None,
    vocab_limit: int | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Would greedy decoding reproduce the continuation? [b] bool. The continuation starts fully masked and
    is decoded one token per step, most confident position first (the greedy low-confidence sampler):
    lm-eval's `is_greedy` for a diffusion model."""
    x = torch.where(target, torch.full_like(x0, mask_id), x0)
    for _ in range(int(target.sum(-1).max())):
        masked = x == mask_id
        if not masked.any():
            break
        logits = logits_fn(x, attention_mask, document_ids).float()
        if vocab_limit is not None:
            logits = logits[..., :vocab_limit]
        logits[..., mask_id] = float("-inf")
        conf, pred = torch.softmax(logits, -1).max(-1)
        conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
        pos = conf.argmax(-1)  # [b]
        rows = masked.any(-1)
        x[rows, pos[rows]] = pred[rows, pos[rows]]
    return (x == x0).all(-1)


def rolling_windows(n_tokens: int, max_len: int, context_len: int, first: int = 1) -> list[tuple[int, int, int]]:
    """Cover tokens first..n_tokens-1 (by default 1..: token 0 is the start-of-document context, e.g. EOS)
    with windows of at most `max_len` tokens: (ctx_start, start, end) scores [start, end) given [ctx_start, start).

    Each window re-reads the `context_len` tokens before it (at least one), so every token is scored once
    with at least min(context_len, its position) tokens of context (lm-eval's rolling log-likelihood with a
    longer overlap: a diffusion model has no cache to carry context across windows)."""
    if not 0 <= context_len < max_len:
        raise ValueError(f"context_len must be in [0, max_len): got {context_len} with max_len {max_len}")
    out, start = [], first
    while start < n_tokens:
        ctx_start = max(0, start - max(context_len, 1 if start == first else 0))
        end = min(n_tokens, ctx_start + max_len)
        out.append((ctx_start, start, end))
        start = end
    return out
