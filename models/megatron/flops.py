"""Model FLOPs of the megatron GPT model of a config and its objective, device peak throughput, and MFU.

Pure Python: the caller's objective (`modes.build_objective`) says how many tokens the network runs on and which
attention pairs it computes; the trainer, the benchmark and tests all count the same way.

Counting convention (as PaLM's MFU, megatron's `num_floating_point_operations`, torchtitan):
- 2 FLOPs per multiply-add of every matrix product: QKV, attention scores and weighted sum, output
  projection, MLP, the LM head over the padded vocabulary, and the small time-conditioning MLPs.
- Norms, softmax, RoPE, activations, residual adds, the loss and the embedding lookup (a gather) are
  left out: they are O(s*h) elementwise work, under 1% of the total at any useful size, and they run on
  vector units rather than the tensor cores the peak figure describes.
- Model FLOPs, not hardware FLOPs: activation recomputation would add work but no model FLOPs, so the
  MFU of a run that recomputes is lower for the same step time, as it should be.
- Packed documents (`model.document_attention`): a token attends within its document only, so the attention
  core counts the sum of squared document lengths, not s^2 (as Megatron-LM counts THD packed sequences); a
  kernel that computes the masked-out blocks anyway (the dense CPU mask) does work the model does not need.
- Causal attention (ar) counts half of the pairs (kernels skip the tiles above the diagonal).
- Block diffusion runs the network on [x_t | x_0] (2L tokens) and its attention computes the pairs its block mask
  allows (`Objective.attention_pairs`: own noisy block, earlier clean blocks, the clean half's rule), as the
  block-sparse FlexAttention kernel skips the rest (at its tile granularity; the dense CPU mask computes all).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from difflm.models.diffusion.arch import ModelArch

if TYPE_CHECKING:  # typing only: keeps this module free of pydantic and torch at import time
    from difflm.config import PipelineConfig
    from difflm.models.diffusion.modes import Objective

# models/diffusion/time_embedding.py: sinusoidal features of t and the adaLN modulation's hidden width
_TIME_FREQ_DIM = 256
_ADALN_COND_DIM = 128


def padded_vocab(vocab_size: int, tensor_parallel: int = 1, multiple: int = 64) -> int:
    """Rows of the embedding / LM head that megatron builds: `vocab_size` rounded up to multiple*TP.

    The same rule as difflm.models.megatron.gpt.padded_vocab_size (a test checks they agree), restated here
    so this module needs no torch. Idempotent: an already padded size comes back unchanged."""
    step = multiple * tensor_parallel
    return (vocab_size + step - 1) // step * step


def _layer_matmul_flops_per_token(cfg: PipelineConfig) -> int:
    """FLOPs of one transformer layer's weight matrices for one token (no attention core)."""
    m, arch = cfg.model, ModelArch.of(cfg.model)
    h, heads = m.hidden_size, m.num_attention_heads
    head_dim = arch.head_width(h, heads)  # model.kv_channels where set (Qwen3: 128, not 1024 / 16)
    kv_heads = m.num_query_groups or heads  # GQA: keys and values have one head per query group
    qkv = 2 * h * head_dim * (heads + 2 * kv_heads)
    proj = 2 * heads * head_dim * h
    mlp = 2 * h * m.ffn_size * arch.mlp_matrices  # gated: gate, up and down matrices
    return qkv + proj + mlp


def _attention_core_flops(cfg: PipelineConfig, objective: Objective, seq_len: int, pairs: float | None = None) -> float:
    """Scores q.k and the weighted sum of v, one layer, one sequence of `seq_len` tokens whose queries and keys
    meet in `pairs` (query, key) pairs: s^2 by default, the sum of squared document lengths with packed
    documents. Causal: flash / cuDNN / TE kernels skip the tiles above the diagonal, so half of them (the usual
    convention; the diagonal tiles make it a little more at small s)."""
    m = cfg.model
    head_dim = ModelArch.of(m).head_width(m.hidden_size, m.num_attention_heads)
    if pairs is None:
        pairs = objective.attention_pairs(seq_len)  # s^2, halved when causal; the block mask's own count
    else:
        pairs = pairs * objective.attention_flops_factor()
    return 2 * 2 * m.num_attention_heads * pairs * head_dim  # two [s, d] x [d, s]-sized products


def _time_conditioning_flops(cfg: PipelineConfig, objective: Objective) -> int:
    """FLOPs of the t -> embedding MLPs for one sequence (one t per sequence, not per token)."""
    d, h = cfg.diffusion, cfg.model.hidden_size
    if not objective.time_conditioned(d.time_embedding):  # as gpt.build_model
        return 0
    if d.time_conditioning == "adaln":  # one modulation MLP per norm: two norms per layer
        per_norm = 2 * (_TIME_FREQ_DIM * _ADALN_COND_DIM + _ADALN_COND_DIM * 2 * h)
        return 2 * cfg.model.num_layers * per_norm
    return 2 * (_TIME_FREQ_DIM * h + h * h)  # input embedding: features -> h -> h


def forward_flops_per_sequence(cfg: PipelineConfig, vocab_size: int, seq_len: int, *, objective: Objective) -> float:
    """Model FLOPs of one forward pass of `objective`'s model over one sequence of `seq_len` tokens.

    `vocab_size` is the tokenizer's (padded here as megatron pads it; a padded size is kept as is)."""
    m = cfg.model
    vocab = padded_vocab(vocab_size, cfg.parallel.tensor_model_parallel_size)
    tokens = objective.model_tokens(seq_len)  # block diffusion: the network runs on 2L tokens
    attention = _attention_core_flops(cfg, objective, seq_len)
    layers = m.num_layers * (tokens * _layer_matmul_flops_per_token(cfg) + attention)
    lm_head = 2 * tokens * m.hidden_size * vocab  # logits over every (padded) row, tied or not
    return float(layers + lm_head + _time_conditioning_flops(cfg, objective))


def training_flops(
    cfg: PipelineConfig,
    vocab_size: int,
    lengths: list[int],
    micro_batch_size: int,
    pairs: list[float] | None = None,
    *,
    objective: Objective,
) -> float:
    """Forward + backward model FLOPs of micro-batches of `micro_batch_size` sequences, one per entry of
    `lengths` (variable-length steps give each micro-batch its own length). `pairs` (packed documents): per
    micro-batch, the sum over its sequences of their squared document lengths (`document_pairs`); the attention
    core then counts those instead of s^2 per sequence.

    Backward is twice the forward (a gradient for the input and one for the weight of every product), so
    3x forward. Counts what the given micro-batches compute: for a whole step under data parallelism pass
    every rank's micro-batches, or multiply one rank's figure by the data-parallel size."""
    rows = objective.rows_per_sequence(evaluation=False)  # complementary masks, MIR: two rows each
    micro_batch_size *= rows
    dense = [micro_batch_size * forward_flops_per_sequence(cfg, vocab_size, n, objective=objective) for n in lengths]
    if pairs is None:
        return 3.0 * sum(dense)
    layers = cfg.model.num_layers
    return 3.0 * sum(  # `pairs` are the clean sequences' documents: every row of a sequence attends within them
        f
        - layers
        * (
            micro_batch_size * _attention_core_flops(cfg, objective, n)
            - _attention_core_flops(cfg, objective, n, rows * p)
        )
        for f, n, p in zip(dense, lengths, pairs)
    )


# Peak dense (no 2:4 sparsity) bf16 tensor-core FLOP/s from the vendors' datasheets. Checked in order,
# as case-insensitive substrings of torch.cuda.get_device_name(): a more specific name comes before a
# substring of it ("GH200" before "H200", "H100 PCIe" before "H100", "L40S" before "L4").
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H200 NVL", 836e12),
    ("H200", 989e12),  # SXM
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("B200", 2250e12),  # HGX B200 at 1000 W
    ("A100", 312e12),  # SXM and PCIe alike
    ("A10G", 70e12),  # AWS's A10 variant: fewer tensor FLOPs than the A10's 125
    ("L40S", 362e12),
    ("L4", 121e12),
)


def peak_flops(device_name: str | None, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of one device: `override_tflops` (train.peak_tflops) if given, else the
    table's figure for `device_name`; None for the CPU or a device the table does not know (no MFU is
    better than one against a guessed peak)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if not device_name:
        return None
    name = device_name.casefold()
    return next((peak for key, peak in PEAK_BF16_FLOPS if key.casefold() in name), None)


def efficiency(flops: float, seconds: float, n_devices: int, peak: float | None) -> dict[str, float | None]:
    """Achieved TFLOP/s per device and MFU (model FLOPs / (seconds * devices * peak); None without a peak)
    of `flops` model FLOPs done by `n_devices` devices in `seconds`."""
    per_device = flops / max(seconds, 1e-12) / max(n_devices, 1)
    return {"tflops_per_device": per_device / 1e12, "mfu": per_device / peak if peak else None}
