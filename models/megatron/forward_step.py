"""The per-micro-batch forward step and loss of every training mode, on a megatron model.

The corruption and loss formulas are in `difflm.models.diffusion` (pure torch); this module wires them to
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
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from difflm.config import PipelineConfig
from difflm.manifest import TokenizerInfo
from difflm.models import diffusion
from difflm.models.diffusion.modes import BlockDiffusion, Objective
from difflm.models.megatron.attention import DocumentMask, TwoStreamMask
from difflm.models.megatron.backend import resolve_backend


@dataclass(frozen=True)
class SpecialTokens:
    mask_id: int
    vocab_size: int
    special_ids: tuple[int, ...]
    eos_id: int = 0
    pad_id: int | None = None

    @classmethod
    def from_manifest(cls, tok: TokenizerInfo) -> SpecialTokens:
        """The ids of a data manifest's tokenizer record (`DataManifest.tokenizer`)."""
        special = tok.special_ids or (tok.eos_id, tok.mask_id, tok.pad_id)
        return cls(tok.mask_id, tok.vocab_size, tuple(sorted(set(special))), tok.eos_id, tok.pad_id)

    def ids(self) -> dict:
        """The ids an objective reads (`Objective`'s token fields)."""
        return {"mask_id": self.mask_id, "vocab_size": self.vocab_size, "pad_id": self.pad_id, "eos_id": self.eos_id}


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


def corrupt(
    batch: dict,
    cfg: PipelineConfig,
    special: SpecialTokens,
    step: int,
    evaluation: bool = False,
    *,
    objective: Objective,
) -> dict:
    """Model inputs, targets, scored positions and t for one micro-batch of `cfg`'s objective (`Objective.prepare`).

    The dataset's loss_mask (False at padding megatron may add) is never scored, never counted; a batch of
    instruction data (`response`, `response_labels`: data prep's loss mask) is scored on its responses only. Evaluation uses
    the objective's bound (for masked modes the low-variance discrete ELBO: t stratified over the batch, exactly
    ceil(t*L) tokens masked, weight L/#masked; see diffusion.elbo_nll_per_token). `objective`: the one the
    caller built where its run started (`build_objective`)."""
    if "response" in batch:  # instruction data: noise and loss on the response tokens only (`modes.prepare`)
        batch = objective.response_view({"loss_mask": torch.ones_like(batch["tokens"]), **batch})
    x0, response = batch["tokens"], batch.get("response")
    label_ok = batch.get("loss_mask", torch.ones_like(x0)).bool()  # megatron's: labels[i] = x[i + 1] is data
    prepared = objective.prepare(
        x0,
        batch["labels"],
        label_ok,
        batch["positions"].tolist(),
        lambda pos: noise_generator(cfg.train.seed, step, pos),
        cfg.train.global_batch_size,
        cfg.diffusion.antithetic_t,
        evaluation,
        response=response,
    )
    if response is not None:  # the clean rows the documents come from (the EOS fill may have changed them)
        prepared.setdefault("row_tokens", x0)
        if "documents" in batch:  # the data's own conversations (a turn's EOS does not end one)
            rows = len(prepared["row_tokens"]) // len(x0)
            prepared["row_documents"] = batch["documents"].repeat(rows, 1)
    return prepared


def _loss_func(prepared: dict, objective: Objective, evaluation: bool, output_tensor: torch.Tensor):
    # THD packs the micro-batch into one row: per-token CE [1, b*s] or logits [1, b*s, V] back to [b, s(, V)]
    output_tensor = output_tensor.reshape(*prepared["inputs"].shape, *output_tensor.shape[2:])
    if objective.full_logits:
        output_tensor = _full_vocab(output_tensor)
    total, count = objective.loss_terms(output_tensor, prepared, evaluation)
    # megatron divides by the global count; the report carries the pair, summed over micro-batches and DP
    return total, count, {"loss": torch.stack([total.detach().float(), count.detach().float()])}


def _full_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, V/TP] gathered to the full vocabulary (the uniform ELBO sums over every state)."""
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
    return {
        k: (v.pin_memory().to(device, non_blocking=True) if cuda else v.to(device))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in tensors.items()
    }


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


def configured_document_form(cfg: PipelineConfig, objective: Objective) -> str | None:
    """`document_form` of `cfg`'s backend and layout for `objective`; None without `model.document_attention`."""
    if not cfg.model.document_attention:
        return None
    if cfg.diffusion.attention_anneal_steps:  # the annealed mask is dense: documents join it there
        return "dense"
    return document_form(
        resolve_backend(cfg.model.backend, objective.two_stream),
        cfg.parallel.pipeline_model_parallel_size,
        cfg.train.micro_batch_size,
    )


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
    cu_seqlens, longest = packed_documents(doc_ids)
    cu_seqlens = to_device({"cu": cu_seqlens}, device)["cu"]
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def attention_mask_for(
    tokens: torch.Tensor,
    objective: Objective,
    special: SpecialTokens,
    form: str | None,
    documents: torch.Tensor | None = None,
):
    """None, or the packed-document mask of `form` ('dense' or 'flex', see `document_form`): document ids in a
    `DocumentMask` for the torch spec (FlexAttention block mask on GPUs), a dense [b, 1, s, s] mask otherwise.
    `documents` [b, s]: the data's own document ids (instruction data); else they come from EOS in `tokens`."""
    if form is None:
        return None
    causal = not objective.bidirectional
    doc = diffusion.document_ids(tokens, special.eos_id) if documents is None else documents
    if form == "flex":
        return DocumentMask(doc, causal)
    return diffusion.document_attention_mask(doc, causal=causal)


def two_stream_mask(
    tokens: torch.Tensor,
    cfg: PipelineConfig,
    special: SpecialTokens,
    objective: Objective,
    documents: torch.Tensor | None = None,
):
    """Block diffusion's attention for the [x_t | x_0] inputs of clean `tokens` [b, L]: a `TwoStreamMask` for the
    torch spec (FlexAttention on GPUs), megatron's dense mask (True = blocked) [b or 1, 1, 2L, 2L] for local.
    `documents`: the data's own document ids (instruction data), else from EOS in `tokens`."""
    assert isinstance(objective, BlockDiffusion), objective.name  # the only two-stream objective
    doc = None
    if cfg.model.document_attention:
        doc = diffusion.document_ids(tokens, special.eos_id) if documents is None else documents
    mask = TwoStreamMask(tokens.shape[1], objective.block_size, objective.token_causal, doc, tokens.device)
    if resolve_backend(cfg.model.backend, True) == "torch":
        return mask
    return ~mask.dense_keep()


def annealed_mask(cfg: PipelineConfig, step: int, evaluation: bool) -> torch.Tensor | None:
    """[s, s] bool (True: blocked) of DiffuLLaMA's attention-mask annealing at training step `step`
    (`diffusion.annealed_attention_mask`), drawn from (seed, step) so that every micro-batch, TP/PP peer and
    resumed run sees the same; None when the config does not anneal. Validation uses full attention."""
    n = cfg.diffusion.attention_anneal_steps
    if not n:
        return None
    if evaluation:
        return torch.zeros(cfg.train.seq_length, cfg.train.seq_length, dtype=torch.bool)
    g = torch.Generator().manual_seed(_seed(cfg.train.seed, step, -11))
    return diffusion.annealed_attention_mask(step, n, cfg.train.seq_length, g)


def make_forward_step(
    cfg: PipelineConfig,
    special: SpecialTokens,
    step: int,
    evaluation: bool = False,
    documents: str | None = None,
    *,
    objective: Objective,
):
    """A megatron `forward_step_func(data_iterator, model)` for training step `step` of `objective` (the trainer's).

    `documents` overrides the form of packed documents (`document_form`; the tests run every form on one spec)."""
    form = (documents or configured_document_form(cfg, objective)) if cfg.model.document_attention else None
    assert form in (None, *DOCUMENT_FORMS), form
    anneal = annealed_mask(cfg, step, evaluation)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        device = model_device(model)
        prepared = corrupt(batch, cfg, special, step, evaluation, objective=objective)
        # the clean tokens of each model row (an objective may run several rows per sequence): their documents
        rows = prepared.get("row_tokens", batch["tokens"])
        documents = prepared.pop("row_documents", None)  # instruction data: its conversations, one per document
        prepared = to_device(prepared, device)
        inputs = prepared["inputs"]
        position_ids = torch.arange(inputs.shape[1], device=device).unsqueeze(0).expand_as(inputs)
        extra = {"t": prepared["t"]} if objective.time_conditioned(cfg.diffusion.time_embedding) else {}
        if objective.two_stream:  # [x_t | x_0]: positions 0..L-1 twice, the block mask
            tokens = inputs[:, inputs.shape[1] // 2 :]  # the clean half: the batch's rows as the objective made them
            position_ids = position_ids % tokens.shape[1]
            mask = two_stream_mask(tokens, cfg, special, objective, None if documents is None else documents.to(device))
            output = model(inputs, position_ids, mask, labels=prepared["targets"], two_stream=True, **extra)
            return output, partial(_loss_func, prepared, objective, evaluation)
        # With labels, megatron returns the per-token (vocab-parallel) cross-entropy [b, s]; without, logits.
        labels = None if objective.full_logits else prepared["targets"]
        if form == "thd":  # one row [1, b*s]; RoPE restarts per document, equal to global positions (relative)
            doc = diffusion.document_ids(rows, special.eos_id) if documents is None else documents
            extra["packed_seq_params"] = packed_seq_params(doc, device)
            inputs, position_ids = inputs.reshape(1, -1), position_ids.reshape(1, -1)
            labels = None if labels is None else labels.reshape(1, -1)
            attention_mask = None
        else:
            doc = None if documents is None else documents.to(device)
            attention_mask = attention_mask_for(rows.to(device), objective, special, form, doc)
        if anneal is not None:  # [1, 1, s, s], joined with the packed-document mask where there is one
            s = inputs.shape[1]
            blocked = anneal[:s, :s].to(device)[None, None]
            attention_mask = blocked if attention_mask is None else attention_mask | blocked
        output = model(inputs, position_ids, attention_mask, labels=labels, **extra)
        return output, partial(_loss_func, prepared, objective, evaluation)

    return forward_step
