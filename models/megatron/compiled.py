"""`model.compile`: the elementwise work of a layer compiled by torch.compile, without Transformer Engine.

On an H200 a 1B step spends about a quarter of its kernel time in unfused elementwise kernels (RoPE's
`torch.cat`, the residual adds, the norms, the casts); Inductor fuses them into a few kernels.
- rope: megatron's unfused rotary embedding (`_apply_rotary_pos_emb_bshd`) compiled; megatron's own fused
  RoPE (`apply_rope_fusion`) is Transformer Engine's kernel only. Packed THD sequences keep megatron's path.
- layers: every transformer layer compiled whole (its norms, residual adds, RoPE and MLP activation fused across
  the GEMMs); megatron's activation recompute still wraps the compiled layers.
The same numbers as off, up to the fused kernels' rounding (tests/unit/models/megatron/test_kernels.py).
"""

from __future__ import annotations

import functools

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import attention as megatron_attention

COMPILED_ROPE_FLAG = "difflm_compiled_rope"  # set on a model's TransformerConfig: read by apply_rotary_pos_emb


@functools.cache
def _compiled_bshd():
    return torch.compile(rope_utils._apply_rotary_pos_emb_bshd, dynamic=None)


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    """megatron's `apply_rotary_pos_emb`, compiled for the [s, b, n, d] layout of a model that asked for it."""
    if getattr(config, COMPILED_ROPE_FLAG, False) and cu_seqlens is None and not config.apply_rope_fusion:
        return _compiled_bshd()(
            t,
            freqs,
            rotary_interleaved=config.rotary_interleaved,
            multi_latent_attention=config.multi_latent_attention,
            mscale=mscale,
        )
    return rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)


# megatron's attention calls the name it imported: routed here once, per model by its config's flag (a model
# without the flag runs megatron's own function, unchanged)
megatron_attention.apply_rotary_pos_emb = apply_rotary_pos_emb


def apply(model, setting: str) -> None:
    """Compile `model`'s parts as `setting` (model.compile) asks; off: nothing."""
    if setting == "rope":
        setattr(model.config, COMPILED_ROPE_FLAG, True)
    elif setting == "layers":
        for layer in model.decoder.layers:
            layer.compile(dynamic=None)
