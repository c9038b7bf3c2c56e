"""The per-micro-batch forward step and loss of every training mode, on a megatron model.

The corruption and loss formulas are in `models.diffusion` (pure torch); this module wires them to
megatron. Noise is drawn per sequence from a generator seeded by (seed, step, position of the sequence
in the global batch): tensor- and pipeline-parallel peers draw the same noise, a resumed run redraws
it, and the noise of a sequence does not depend on the micro-batch / data-parallel split, so every
parallel layout computes the same loss on the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from difflm.config import PipelineConfig
from models import diffusion


@dataclass(frozen=True)
class SpecialTokens:
    mask_id: int
    vocab_size: int
    special_ids: tuple[int, ...]
    eos_id: int = 0

    @classmethod
    def from_manifest(cls, tok: dict) -> "SpecialTokens":
        special = tok.get("special_ids") or [tok["eos_id"], tok["mask_id"], tok["pad_id"]]
        return cls(tok["mask_id"], tok["vocab_size"], tuple(sorted(set(special))), tok["eos_id"])

    def allowed_ids(self) -> torch.Tensor:
        """Ids uniform noise may draw: the vocabulary without special tokens."""
        keep = torch.ones(self.vocab_size, dtype=torch.bool)
        keep[list(self.special_ids)] = False
        return keep.nonzero().squeeze(-1)


def _seed(*parts: int) -> int:
    h = 1469598103934665603
    for p in parts:  # FNV-1a style mixing of signed ints: distinct streams per tuple
        h = ((h ^ (p & 0xFFFFFFFFFFFF)) * 1099511628211) % (2**61 - 1)
    return h


def noise_generator(seed: int, step: int, sample: int) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(seed, step, sample))


def varilen_length(seed: int, step: int, seq_length: int, prob: float, multiple: int = 1) -> int:
    """The sequence length of training step `step`: seq_length, or with probability `prob` a length
    drawn uniformly from [multiple, seq_length] rounded up to `multiple` (TP/SP need divisibility).
    Depends only on (seed, step): identical on every rank and on resume."""
    if prob <= 0:
        return seq_length
    g = torch.Generator().manual_seed(_seed(seed, step, -7))
    if torch.rand((), generator=g).item() >= prob:
        return seq_length
    length = int(torch.randint(1, seq_length + 1, (), generator=g))
    return min(seq_length, -(-length // multiple) * multiple)


def corrupt(batch: dict, cfg: PipelineConfig, special: SpecialTokens, step: int, evaluation: bool = False) -> dict:
    """Model inputs, targets, scored positions and t for one micro-batch of `cfg`'s objective.

    evaluation=True uses the low-variance discrete form of the masked-diffusion ELBO: t stratified over
    the batch, exactly ceil(t*L) tokens masked, weight L/#masked (see diffusion.elbo_nll_per_token)."""
    x0, mode, d = batch["tokens"], cfg.diffusion.model_running_mode, cfg.diffusion
    if mode == "ar":
        return {"inputs": x0, "targets": batch["labels"], "scored": torch.ones_like(x0, dtype=torch.bool), "t": None}
    rows, ts, flags = [], [], []
    allowed = special.allowed_ids() if mode == "difflm-noshift-uniform" else None
    for row, pos in zip(x0, batch["positions"].tolist()):
        g = noise_generator(cfg.train.seed, step, pos)
        t = diffusion.stratified_t(torch.rand(1, generator=g), torch.tensor([pos]), cfg.train.global_batch_size,
                                   d.eps, d.antithetic_t or evaluation)
        if allowed is not None:
            xt, flag = diffusion.uniform_corrupt(row[None], t, allowed, g)
        elif evaluation:
            count = (t * row.numel()).ceil().clamp(1, row.numel()).long()
            xt, flag = diffusion.mask_exactly(row[None], count, special.mask_id, g)
        else:
            xt, flag = diffusion.mask_tokens(row[None], t, special.mask_id, g)
        rows.append(xt), ts.append(t), flags.append(flag)
    xt, t, masked = torch.cat(rows), torch.cat(ts), torch.cat(flags)
    if mode == "difflm-shift":
        targets, scored = diffusion.shift_targets(x0, masked)
        return {"inputs": xt, "targets": targets, "scored": scored, "t": t}
    return {"inputs": xt, "targets": x0, "scored": masked, "t": t}


def loss_from_token_ce(token_ce: torch.Tensor, prepared: dict, cfg: PipelineConfig,
                       evaluation: bool = False) -> torch.Tensor:
    d = cfg.diffusion
    if d.model_running_mode == "ar":
        return token_ce.float().mean()
    if d.model_running_mode == "difflm-noshift-uniform":
        return diffusion.uniform_diffusion_loss(token_ce.float())
    if evaluation:  # the ELBO in nats/token, whatever the training weighting
        return diffusion.masked_diffusion_loss(token_ce.float(), prepared["scored"], prepared["t"],
                                               "masked_fraction", "all_tokens")
    return diffusion.masked_diffusion_loss(token_ce.float(), prepared["scored"], prepared["t"], d.loss_weighting,
                                           d.normalize_by)


def _loss_func(prepared: dict, cfg: PipelineConfig, evaluation: bool, output_tensor: torch.Tensor):
    loss = loss_from_token_ce(output_tensor, prepared, cfg, evaluation)
    return loss, {"loss": loss.detach().clone()}


def make_forward_step(cfg: PipelineConfig, special: SpecialTokens, step: int, evaluation: bool = False):
    """A megatron `forward_step_func(data_iterator, model)` for training step `step`."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        prepared = corrupt(batch, cfg, special, step, evaluation)
        inputs = prepared["inputs"]
        position_ids = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
        attention_mask = None
        if cfg.model.document_attention:
            doc = diffusion.document_ids(batch["tokens"], special.eos_id)
            attention_mask = diffusion.document_attention_mask(doc, causal=cfg.diffusion.model_running_mode == "ar")
        # With labels, megatron returns the per-token (vocab-parallel) cross-entropy [b, s].
        extra = {"t": prepared["t"]} if cfg.diffusion.time_embedding and prepared["t"] is not None else {}
        token_ce = model(inputs, position_ids, attention_mask, labels=prepared["targets"], **extra)
        return token_ce, partial(_loss_func, prepared, cfg, evaluation)

    return forward_step
