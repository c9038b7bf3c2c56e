"""The per-micro-batch forward step and loss of every training mode, on a megatron model.

The corruption and loss formulas are in `models.diffusion` (pure torch); this module wires them to
megatron. Noise is drawn per sequence from a generator seeded by (seed, step, position of the sequence
in the global batch): tensor- and pipeline-parallel peers draw the same noise, a resumed run redraws
it, and the noise of a sequence does not depend on the micro-batch / data-parallel split. The loss
function returns (sum, count) and megatron divides by the global count (`calculate_per_token_loss`), so
every normalisation gives the same loss on the same batch whatever the parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from difflm.config import PipelineConfig
from models import diffusion
from models.diffusion import uniform


@dataclass(frozen=True)
class SpecialTokens:
    mask_id: int
    vocab_size: int
    special_ids: tuple[int, ...]
    eos_id: int = 0
    pad_id: int | None = None

    @classmethod
    def from_manifest(cls, tok: dict) -> "SpecialTokens":
        special = tok.get("special_ids") or [tok["eos_id"], tok["mask_id"], tok["pad_id"]]
        return cls(tok["mask_id"], tok["vocab_size"], tuple(sorted(set(special))), tok["eos_id"], tok.get("pad_id"))

    def uniform_states(self) -> torch.Tensor:
        return uniform.uniform_states(self.vocab_size, self.mask_id, self.pad_id)


def _seed(*parts: int) -> int:
    h = 1469598103934665603
    for p in parts:  # FNV-1a style mixing of signed ints: distinct streams per tuple
        h = ((h ^ (p & 0xFFFFFFFFFFFF)) * 1099511628211) % (2**61 - 1)
    return h


def noise_generator(seed: int, step: int, sample: int) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(seed, step, sample))


def varilen_length(seed: int, step: int, seq_length: int, prob: float, multiple: int = 1, micro: int = 0) -> int:
    """The sequence length of micro-batch `micro` of training step `step`: seq_length, or with probability
    `prob` a length drawn uniformly from [2, seq_length] rounded up to `multiple` (TP/SP need divisibility).
    Depends only on (seed, step, micro): identical on every TP/PP peer and on resume."""
    if prob <= 0:
        return seq_length
    g = torch.Generator().manual_seed(_seed(seed, step, -7, micro))
    if torch.rand((), generator=g).item() >= prob:
        return seq_length
    length = int(torch.randint(2, seq_length + 1, (), generator=g))
    return min(seq_length, -(-length // multiple) * multiple)


def _exact_counts(cfg: PipelineConfig, evaluation: bool) -> bool:
    """Exactly ceil(t L) masks (LLaDA's discrete ELBO) in evaluation, and in training with masked_fraction
    weighting, whose L/#masked weight is unbiased only for counts uniform on {1..L}."""
    return evaluation or cfg.diffusion.loss_weighting == "masked_fraction"


def corrupt(batch: dict, cfg: PipelineConfig, special: SpecialTokens, step: int, evaluation: bool = False) -> dict:
    """Model inputs, targets, scored positions and t for one micro-batch of `cfg`'s objective.

    `valid` [b, s] is the dataset's loss_mask (False at padding megatron may add): never scored, never
    counted. Evaluation uses the low-variance discrete form of the masked ELBO: t stratified over the
    batch, exactly ceil(t*L) tokens masked, weight L/#masked (see diffusion.elbo_nll_per_token)."""
    x0, mode, d = batch["tokens"], cfg.diffusion.model_running_mode, cfg.diffusion
    label_ok = batch.get("loss_mask", torch.ones_like(x0)).bool()  # megatron's: labels[i] = x[i + 1] is data
    if mode == "ar":
        return {"inputs": x0, "targets": batch["labels"], "scored": label_ok, "valid": label_ok, "t": None}
    # diffusion scores tokens[i] = x[i], which is data iff labels[i - 1] is (token 0 always is)
    valid = torch.cat([torch.ones_like(label_ok[:, :1]), label_ok[:, :-1]], dim=1)
    rows, ts, flags = [], [], []
    states = special.uniform_states() if mode == "difflm-noshift-uniform" else None
    for row, ok, pos in zip(x0, valid, batch["positions"].tolist()):
        g = noise_generator(cfg.train.seed, step, pos)
        t = diffusion.stratified_t(torch.rand(1, generator=g), torch.tensor([pos]), cfg.train.global_batch_size,
                                   d.eps, d.antithetic_t or evaluation)
        if states is not None:  # small t drawn more often, weighted back (see uniform.mixture_t)
            t = uniform.mixture_t((t - d.eps) / (1 - d.eps), d.eps)
            xt, flag = diffusion.uniform_corrupt(row[None], t, states, g)
        elif _exact_counts(cfg, evaluation):
            n_valid = int(ok.sum())
            count = (t * n_valid).ceil().clamp(1, max(n_valid, 1)).long()
            xt, flag = diffusion.mask_exactly(row[None], count, special.mask_id, g, ok[None])
        else:
            xt, flag = diffusion.mask_tokens(row[None], t, special.mask_id, g)
        rows.append(xt), ts.append(t), flags.append(flag)
    xt, t, masked = torch.cat(rows), torch.cat(ts), torch.cat(flags)
    if mode == "difflm-shift":
        targets, scored = diffusion.shift_targets(x0, masked)
        return {"inputs": xt, "targets": targets, "scored": scored & valid, "valid": valid, "t": t}
    return {"inputs": xt, "targets": x0, "scored": masked & valid, "valid": valid, "t": t}


def loss_terms(token_ce: torch.Tensor, prepared: dict, cfg: PipelineConfig,
               evaluation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of the masked / AR loss from per-token cross-entropy [b, s]: loss = sum / count globally."""
    d = cfg.diffusion
    if d.model_running_mode == "ar":
        return diffusion.x0_cross_entropy_terms(token_ce.float(), prepared["valid"])
    weighting, normalize_by = (("masked_fraction", "all_tokens") if evaluation  # the ELBO, whatever the training
                               else (d.loss_weighting, d.normalize_by))
    return diffusion.masked_diffusion_loss_terms(token_ce.float(), prepared["scored"], prepared["t"], weighting,
                                                 normalize_by, prepared["valid"])


def uniform_loss_terms(logits: torch.Tensor, prepared: dict, cfg: PipelineConfig, states: torch.Tensor,
                       evaluation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of difflm-noshift-uniform from full logits [b, s, V]: the continuous-time NELBO (UDLM)
    per token, or in training with `diffusion.uniform_loss=x0_ce` plain x0 cross-entropy (validation always
    reports the ELBO)."""
    x0, xt = prepared["targets"], prepared["inputs"]
    x0_idx = uniform.state_index(x0, states, logits.shape[-1])
    valid = prepared["valid"] & (x0_idx >= 0)  # a target outside the states (pad) cannot be scored
    log_p = uniform.state_log_probs(logits, states.to(logits.device))  # [b, s, N]
    x0_idx = x0_idx.clamp(min=0)
    if cfg.diffusion.uniform_loss == "x0_ce" and not evaluation:
        ce = -log_p.gather(-1, x0_idx[..., None]).squeeze(-1)
        return diffusion.x0_cross_entropy_terms(ce, valid)
    xt_idx = uniform.state_index(xt, states, logits.shape[-1]).clamp(min=0)
    t = prepared["t"].to(logits.device)
    integrand = uniform.nelbo_integrand(log_p, x0_idx, xt_idx, t)  # [b, s]
    # the integral over [eps, 1] as an importance-sampled mean: t came from uniform.mixture_t
    total = ((integrand * valid).sum(-1) * uniform.mixture_weight(t, cfg.diffusion.eps)).sum()
    return total.to(torch.float32), valid.sum().to(torch.int)


def _loss_func(prepared: dict, cfg: PipelineConfig, evaluation: bool, states, output_tensor: torch.Tensor):
    # THD packs the micro-batch into one row: per-token CE [1, b*s] or logits [1, b*s, V] back to [b, s(, V)]
    output_tensor = output_tensor.reshape(*prepared["inputs"].shape, *output_tensor.shape[2:])
    if states is not None:
        total, count = uniform_loss_terms(_full_vocab(output_tensor), prepared, cfg, states, evaluation)
    else:
        total, count = loss_terms(output_tensor, prepared, cfg, evaluation)
    # megatron divides by the global count; the report carries the pair, summed over micro-batches and DP
    return total, count, {"loss": torch.stack([total.detach().float(), count.detach().float()])}


def _full_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, V/TP] gathered to the full vocabulary (the uniform ELBO sums over every state)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return logits
    return gather_from_tensor_model_parallel_region(logits)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def to_device(tensors: dict, device: torch.device) -> dict:
    """The device rule: every tensor of a step on the model's device. Batches and noise are made on the CPU
    (the noise from CPU generators, so every device and layout draws the same numbers); to a GPU they go
    through pinned memory as non-blocking copies, as Megatron-LM's get_batch does."""
    cuda = device.type == "cuda"
    return {k: (v.pin_memory().to(device, non_blocking=True) if cuda else v.to(device))
            if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}


DOCUMENT_FORMS = ("dense", "flex", "thd")


def document_form(backend: str, pipeline_parallel: int = 1, micro_batch_size: int = 1) -> str:
    """How packed documents reach the attention of `backend`'s layer spec: 'dense', a [b, 1, s, s] mask (local);
    'flex', document ids in a `DocumentMask` (torch: a FlexAttention block mask on CUDA); 'thd', packed sequences
    (te: `PackedSeqParams`, the micro-batch flattened to one row [1, b*s], every document one sequence), as
    Megatron-LM and MegaDLMs give Transformer Engine packed documents.

    TE keeps the dense mask when pipeline stages would exchange a THD micro-batch of b > 1 rows: megatron's p2p
    buffers are shaped [s, b, h] from (seq_length, micro_batch_size), a THD activation is [b*s, 1, h]."""
    if backend == "local":
        return "dense"
    if backend == "torch":
        return "flex"
    return "dense" if pipeline_parallel > 1 and micro_batch_size > 1 else "thd"


def configured_document_form(cfg: PipelineConfig) -> str | None:
    """`document_form` of `cfg`'s backend and layout; None without `model.document_attention`."""
    if not cfg.model.document_attention:
        return None
    from models.megatron.backend import resolve_backend

    return document_form(resolve_backend(cfg.model.backend), cfg.parallel.pipeline_model_parallel_size,
                         cfg.train.micro_batch_size)


def packed_documents(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 [n + 1], longest length) of the documents of `doc_ids` [b, s] with the rows
    concatenated: a new sequence starts at every row start and wherever the document id changes, so a document
    never crosses a row boundary (a row without EOS is one sequence; an EOS ends its own document)."""
    b, s = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = starts.flatten().nonzero().flatten()
    cu_seqlens = torch.cat([first, first.new_tensor([b * s])]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def packed_seq_params(doc_ids: torch.Tensor, device: torch.device):
    """megatron's `PackedSeqParams` (qkv_format 'thd') for the packed documents of `doc_ids` [b, s]. Give CPU ids:
    the boundaries and the longest length (a Python int TE needs) are then found without a device sync."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens, longest = packed_documents(doc_ids)
    cu_seqlens = to_device({"cu": cu_seqlens}, device)["cu"]
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def attention_mask_for(tokens: torch.Tensor, cfg: PipelineConfig, special: SpecialTokens, form: str | None):
    """None, or the packed-document mask of `form` ('dense' or 'flex', see `document_form`): document ids in a
    `DocumentMask` for the torch spec (FlexAttention block mask on GPUs), a dense [b, 1, s, s] mask otherwise."""
    if form is None:
        return None
    causal = cfg.diffusion.model_running_mode == "ar"
    doc = diffusion.document_ids(tokens, special.eos_id)
    if form == "flex":
        from models.megatron.attention import DocumentMask

        return DocumentMask(doc, causal)
    return diffusion.document_attention_mask(doc, causal=causal)


def make_forward_step(cfg: PipelineConfig, special: SpecialTokens, step: int, evaluation: bool = False,
                      documents: str | None = None):
    """A megatron `forward_step_func(data_iterator, model)` for training step `step`.

    `documents` overrides the form of packed documents (`document_form`; the tests run every form on one spec)."""
    states = special.uniform_states() if cfg.diffusion.model_running_mode == "difflm-noshift-uniform" else None
    form = (documents or configured_document_form(cfg)) if cfg.model.document_attention else None
    assert form in (None, *DOCUMENT_FORMS), form

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        device = model_device(model)
        prepared = to_device(corrupt(batch, cfg, special, step, evaluation), device)
        inputs = prepared["inputs"]
        position_ids = torch.arange(inputs.shape[1], device=device).unsqueeze(0).expand_as(inputs)
        extra = {"t": prepared["t"]} if cfg.diffusion.time_embedding and prepared["t"] is not None else {}
        # With labels, megatron returns the per-token (vocab-parallel) cross-entropy [b, s]; without, logits.
        labels = None if states is not None else prepared["targets"]
        if form == "thd":  # one row [1, b*s]; RoPE restarts per document, equal to global positions (relative)
            extra["packed_seq_params"] = packed_seq_params(diffusion.document_ids(batch["tokens"], special.eos_id),
                                                           device)
            inputs, position_ids = inputs.reshape(1, -1), position_ids.reshape(1, -1)
            labels = None if labels is None else labels.reshape(1, -1)
            attention_mask = None
        else:
            attention_mask = attention_mask_for(batch["tokens"].to(device), cfg, special, form)
        output = model(inputs, position_ids, attention_mask, labels=labels, **extra)
        return output, partial(_loss_func, prepared, cfg, evaluation, states)

    return forward_step
