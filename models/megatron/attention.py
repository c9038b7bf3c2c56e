"""The `torch` backend: megatron-core's layers with PyTorch's own fused attention, no Transformer Engine.

megatron-core's local spec computes attention as baddbmm + an unfused softmax + bmm: it materialises the
[b, n, s, s] scores and cannot use flash kernels. This module supplies the two spec pieces that change:

- `TorchCoreAttention`, a drop-in for the spec's `core_attention`, on
  `torch.nn.functional.scaled_dot_product_attention` (flash / cuDNN / memory-efficient kernels on GPUs) for
  bidirectional and causal attention, and on FlexAttention block masks for packed documents on CUDA;
- `TorchNorm`, torch's RMSNorm / LayerNorm whose parameters are marked for sequence parallelism, so that
  megatron's `finalize_model_grads` all-reduces their gradients across tensor-parallel ranks (megatron's
  `WrappedTorchNorm` refuses sequence parallelism instead).

Checkpoints are interchangeable with the local spec: same modules, same parameter names.

Packed documents reach the attention as a `DocumentMask` (document ids, not a dense mask): megatron passes
the attention mask through to every layer untouched, so the mask is built once per forward and shared. The
attention also takes Transformer Engine's form, megatron's `PackedSeqParams` with qkv_format 'thd' (one row,
every document a sequence of `cu_seqlens`, the direction from the spec's mask type as TE takes it): the same
`DocumentMask` is built from the boundaries, so the TE path's inputs are tested here without TE.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.utils import divide
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from difflm.models.diffusion.blocks import allowed, two_stream_keep
from difflm.models.diffusion.documents import document_attention_mask


class DocumentMask:
    """Packed documents of one micro-batch: ids [b, s] and the direction of attention.

    On CUDA it becomes a FlexAttention `BlockMask` (block-sparse: blocks across documents are skipped, no
    [b, 1, s, s] tensor); elsewhere, or with attention dropout, a dense boolean mask for SDPA. Built once,
    on first use, and reused by every layer of the forward."""

    def __init__(self, doc_ids: torch.Tensor, causal: bool):
        self.doc_ids, self.causal = doc_ids, causal
        self._dense: torch.Tensor | None = None
        self._block = None

    def dense_keep(self) -> torch.Tensor:
        """[b, 1, s, s] bool, True where attention is ALLOWED (SDPA's convention)."""
        if self._dense is None:
            self._dense = ~document_attention_mask(self.doc_ids, self.causal)
        return self._dense

    def block_mask(self):
        if self._block is None:
            doc, causal = self.doc_ids, self.causal

            def same_document(b, h, q, k):
                keep = doc[b, q] == doc[b, k]
                return keep & (q >= k) if causal else keep

            b, s = doc.shape
            self._block = create_block_mask(same_document, B=b, H=None, Q_LEN=s, KV_LEN=s, device=doc.device)
        return self._block


class TwoStreamMask:
    """Block diffusion's `[x_t | x_0]` attention (`difflm.models.diffusion.blocks`) for one micro-batch of L tokens:
    on CUDA a FlexAttention `BlockMask` built from the rule as a mask_mod (block-sparse, no [2L, 2L] tensor:
    the tiles of later clean blocks and of other noisy blocks are skipped), elsewhere the dense keep mask.
    Packed documents (`doc_ids` [b, L]) restrict it further. Built once per forward, shared by every layer."""

    def __init__(
        self, length: int, block_size: int, token_causal: bool, doc_ids: torch.Tensor | None = None, device=None
    ):
        self.length, self.block_size, self.token_causal, self.doc_ids = length, block_size, token_causal, doc_ids
        self.device = doc_ids.device if doc_ids is not None else device
        self._dense: torch.Tensor | None = None
        self._block = None

    def dense_keep(self) -> torch.Tensor:
        """[b or 1, 1, 2L, 2L] bool, True where attention is ALLOWED."""
        if self._dense is None:
            self._dense = two_stream_keep(
                self.length, self.block_size, self.token_causal, self.doc_ids, device=self.device
            )
        return self._dense

    def mask_mod(self):
        """FlexAttention's mask_mod(b, h, q, k) of the rule: index arithmetic only."""
        length, size, token_causal, doc = self.length, self.block_size, self.token_causal, self.doc_ids

        def two_stream(b, h, q, k):
            q_noisy, k_noisy = q < length, k < length
            q_pos = torch.where(q_noisy, q, q - length)
            k_pos = torch.where(k_noisy, k, k - length)
            keep = allowed(q_noisy, q_pos // size, q_pos, k_noisy, k_pos // size, k_pos, token_causal)
            return keep & (doc[b, q_pos] == doc[b, k_pos]) if doc is not None else keep

        return two_stream

    def block_mask(self, device=None):
        if self._block is None:
            b = None if self.doc_ids is None else self.doc_ids.shape[0]
            n = 2 * self.length
            dev = torch.device(device if device is not None else self.device)
            # compiled on GPUs: the mask_mod is evaluated tile by tile, never as a [2L, 2L] tensor
            self._block = create_block_mask(
                self.mask_mod(), B=b, H=None, Q_LEN=n, KV_LEN=n, device=dev, _compile=dev.type == "cuda"
            )
        return self._block


def thd_document_mask(packed_seq_params, causal: bool, total: int) -> DocumentMask:
    """The `DocumentMask` [1, total] of THD packed sequences: position i belongs to the sequence whose
    [cu_seqlens[j], cu_seqlens[j + 1]) holds it. Kept on the params object, which megatron hands every layer,
    so it is built once per forward."""
    cached = getattr(packed_seq_params, "_document_mask", None)
    if cached is not None and cached.causal == causal:
        return cached
    if packed_seq_params.cu_seqlens_q_padded is not None or packed_seq_params.cu_seqlens_kv_padded is not None:
        raise RuntimeError("padded THD sequences (cu_seqlens_*_padded) need model.backend=te")
    cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
    if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_q, cu_kv):
        raise RuntimeError("THD self-attention needs the same query and key sequences")
    lengths = (cu_q[1:] - cu_q[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=cu_q.device), lengths, output_size=total)
    mask = DocumentMask(doc[None], causal)
    packed_seq_params._document_mask = mask
    return mask


_FLEX = None


def _flex_attention():
    """FlexAttention compiled once per process: uncompiled, it is a slow O(s^2) reference implementation."""
    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=None)  # dynamic shapes after a second length is seen
    return _FLEX


def use_flex(device: torch.device, dropout_p: float) -> bool:
    """FlexAttention has no CPU backward and no dropout: there the dense mask goes to SDPA instead."""
    return device.type == "cuda" and dropout_p == 0.0


class TorchCoreAttention(MegatronModule):
    """megatron's `DotProductAttention` contract ([s, b, n, d] in, [s, b, n*d] out) on torch's kernels."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise RuntimeError("context parallelism needs model.backend=te")
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise RuntimeError("window attention and softmax variants need model.backend=local or te")
        self.attn_mask_type = attn_mask_type
        self.causal_type = AttnMaskType.causal
        head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        # megatron's apply_query_key_layer_scaling divides the scale by the layer number and its fused
        # softmax multiplies it back: the net scale is this one
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if attention_bias is not None:
            raise RuntimeError("attention biases need model.backend=te")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if packed_seq_params is not None:
            attention_mask = self._thd_mask(packed_seq_params, mask_type, query.shape[0])
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))  # [t, n, d] -> [t, 1, n, d]
        s, b = query.shape[0], query.shape[1]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, n, s, d]
        dropout_p = self.dropout if self.training else 0.0
        if dropout_p > 0 and not self.config.sequence_parallel:  # as DotProductAttention: TP ranks' own seeds
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._attend(q, k, v, attention_mask, mask_type, dropout_p)
        else:
            out = self._attend(q, k, v, attention_mask, mask_type, dropout_p)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, n*d]

    def _thd_mask(self, packed_seq_params, mask_type, total: int) -> DocumentMask:
        """TE's reading of THD: sequences apart, causal within one under a causal spec, else bidirectional."""
        if packed_seq_params.qkv_format != "thd":
            raise RuntimeError(f"packed sequences in {packed_seq_params.qkv_format!r} need model.backend=te")
        if mask_type not in (
            AttnMaskType.causal,
            AttnMaskType.padding_causal,
            AttnMaskType.no_mask,
            AttnMaskType.padding,
        ):
            raise RuntimeError(f"THD packed sequences need a causal or no_mask spec, not {mask_type.name}")
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        return thd_document_mask(packed_seq_params, causal, total)

    def _attend(self, q, k, v, attention_mask, mask_type, dropout_p: float):
        grouped = q.shape[1] != k.shape[1]
        masks = (DocumentMask, TwoStreamMask)
        if isinstance(attention_mask, masks) and use_flex(q.device, dropout_p):
            block_mask = (
                attention_mask.block_mask(q.device)
                if isinstance(attention_mask, TwoStreamMask)
                else attention_mask.block_mask()
            )
            return _flex_attention()(q, k, v, block_mask=block_mask, scale=self.softmax_scale, enable_gqa=grouped)
        if isinstance(attention_mask, masks):
            keep = attention_mask.dense_keep()
        elif attention_mask is not None:
            keep = ~attention_mask.bool()  # megatron's masks are True where attention is blocked
        else:
            keep = None
        if keep is not None and grouped:
            # masked SDPA runs the memory-efficient kernel, which has no grouped-query form: repeat k/v
            # rather than fall back to the math kernel
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            grouped = False
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=keep,
            dropout_p=dropout_p,
            scale=self.softmax_scale,
            enable_gqa=grouped,
            is_causal=keep is None and mask_type == self.causal_type,
        )


class TorchNorm:
    """torch's RMSNorm / LayerNorm as megatron builds norms, `norm(config, hidden_size, eps)`, with parameters
    marked `sequence_parallel` under SP: each TP rank then sees s/TP positions and megatron all-reduces the
    norms' gradients across TP (unmarked, the replicas would drift apart)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_cls = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}[config.normalization]
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def torch_layer_spec(spec):
    """The local layer spec turned into the torch backend's: SDPA core attention, SP-capable norms."""
    attn = spec.submodules.self_attention.submodules
    attn.core_attention = TorchCoreAttention
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attn, name) is not IdentityOp:
            setattr(attn, name, TorchNorm)
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = TorchNorm
    return spec


def block_spec(layer, config):
    """A transformer-block spec with `layer` repeated and our final norm (megatron's default final norm is
    `WrappedTorchNorm` without apex or TE, which refuses sequence parallelism)."""
    layers = [layer] * get_num_layers_to_build(config)
    return ModuleSpec(
        module=TransformerBlock, submodules=TransformerBlockSubmodules(layer_specs=layers, layer_norm=TorchNorm)
    )
