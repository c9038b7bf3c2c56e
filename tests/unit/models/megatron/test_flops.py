"""Model FLOPs, device peaks and MFU (models/megatron/flops.py): by hand, and against counted forwards."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from difflm.config import load_config
from difflm.models.diffusion.documents import document_ids, document_pairs
from difflm.models.diffusion.modes import build_objective
from difflm.models.hf.convert import hf_config
from difflm.models.hf.modeling_difflm import DiffLMForMaskedLM
from difflm.models.megatron import flops
from difflm.models.megatron.data import build_datasets, micro_batch
from difflm.models.megatron.flops import efficiency, padded_vocab, peak_flops
from difflm.models.megatron.forward_step import SpecialTokens
from difflm.models.megatron.gpt import build_model, padded_vocab_size
from difflm.models.megatron.train import build_training, run_global_batch

TOKENIZER = {"vocab_size": 1000, "mask_id": 1, "eos_id": 0, "pad_id": 2}
SHAPE = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4"]
VARIANTS = {
    "swiglu-tied": [],
    "gqa-gelu-untied": ["model.num_query_groups=2", "model.gated_mlp=false", "model.tie_embeddings=false"],
    # a head width apart from hidden / heads (model.kv_channels, as Qwen3 imports): both the matrices and the core
    "kv-channels-qknorm": ["model.num_query_groups=2", "model.qk_layernorm=true", "model.kv_channels=32"],
    "gemma-style": [
        "model.activation=gelu_tanh",
        "model.norm_offset=1",
        "model.embedding_scale=true",
        "model.kv_channels=8",
    ],
    "time-input": ["diffusion.time_embedding=true", "diffusion.time_conditioning=input"],
    "time-adaln": ["diffusion.time_embedding=true", "diffusion.time_conditioning=adaln"],
}


def forward_flops_per_sequence(cfg, vocab_size: int, seq_len: int) -> float:
    """The count for `cfg`'s objective, built as the trainer builds it."""
    return flops.forward_flops_per_sequence(cfg, vocab_size, seq_len, objective=build_objective(cfg.diffusion))


def training_flops(cfg, vocab_size: int, lengths: list[int], micro_batch_size: int, pairs=None) -> float:
    return flops.training_flops(
        cfg, vocab_size, lengths, micro_batch_size, pairs, objective=build_objective(cfg.diffusion)
    )


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


def _hand_cfg(mode: str, *overrides: str):
    return _cfg(
        "model.num_layers=2",
        "model.hidden_size=16",
        "model.num_attention_heads=2",
        "model.num_query_groups=1",
        "model.ffn_hidden_size=32",
        f"diffusion.model_running_mode={mode}",
        *overrides,
    )


def test_hand_checked_tiny_config():
    """h=16, 2 heads of 8, one KV group, SwiGLU ffn 32, 2 layers, vocab 64, 8 tokens, worked out on paper."""
    s, h = 8, 16
    qkv = 2 * h * 8 * (2 + 2 * 1)  # 2 query heads + one key and one value head of 8 = 1024 per token
    proj = 2 * h * h  # 512
    mlp = 2 * h * 32 * 3  # gate, up, down = 3072
    scores_and_sum = 2 * 2 * 2 * s * s * 8  # 2 products x 2 heads x s x s x head_dim = 4096 per layer
    lm_head = 2 * s * h * 64  # 16384
    bidirectional = 2 * (s * (qkv + proj + mlp) + scores_and_sum) + lm_head
    assert bidirectional == 98304
    assert forward_flops_per_sequence(_hand_cfg("difflm-noshift"), 64, s) == bidirectional
    # causal: half the attention core (flash kernels skip the masked half); the matrices are the same
    assert forward_flops_per_sequence(_hand_cfg("ar"), 64, s) == bidirectional - 2 * scores_and_sum / 2 == 94208
    for mode in ("difflm-shift", "difflm-noshift-uniform"):  # every diffusion mode attends both ways
        assert forward_flops_per_sequence(_hand_cfg(mode), 64, s) == bidirectional


def test_time_conditioning_is_per_sequence():
    base = _hand_cfg("difflm-noshift")
    t_input = _hand_cfg("difflm-noshift", "diffusion.time_embedding=true", "diffusion.time_conditioning=input")
    extra = 2 * (256 * 16 + 16 * 16)  # sinusoidal features -> h -> h, once per sequence whatever its length
    for s in (8, 32):
        assert forward_flops_per_sequence(t_input, 64, s) - forward_flops_per_sequence(base, 64, s) == extra


def test_vocab_is_padded_as_megatron_pads_it():
    for v in (50, 64, 65, 1000, 50257):
        for tp in (1, 2, 8):
            assert padded_vocab(v, tp) == padded_vocab_size(v, tp)
            assert padded_vocab(padded_vocab(v, tp), tp) == padded_vocab(v, tp)  # a padded size is kept
    cfg = _hand_cfg("difflm-noshift")
    assert forward_flops_per_sequence(cfg, 50, 8) == forward_flops_per_sequence(cfg, 64, 8)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_a_counted_forward_of_the_hf_model(variant):
    """The exported model has megatron's shapes; FlopCounterMode counts its every product.

    The math SDPA backend: FlopCounterMode has no formula for the CPU's fused attention kernel
    (`_scaled_dot_product_flash_attention_for_cpu`) and would count no attention at all."""
    cfg = _cfg(*SHAPE, *VARIANTS[variant])
    torch.manual_seed(0)
    model = DiffLMForMaskedLM(hf_config(cfg, TOKENIZER)).eval()
    b, s = 2, 96
    tokens = torch.randint(3, TOKENIZER["vocab_size"], (b, s))
    extra = {"t": torch.rand(b)} if cfg.diffusion.time_embedding else {}
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, **extra)
    counted = counter.get_total_flops() / b
    assert counted == pytest.approx(forward_flops_per_sequence(cfg, TOKENIZER["vocab_size"], s), rel=0.01)


def test_causal_counts_half_the_attention_a_counter_sees_in_full():
    """The counter (and the math/unfused kernels it can see) computes the whole s x s and masks it; flash
    kernels skip the masked half, which is what the formula counts for `ar`."""
    ar = _cfg(*SHAPE, "diffusion.model_running_mode=ar")
    model = DiffLMForMaskedLM(hf_config(ar, TOKENIZER)).eval()
    s = 96
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.randint(3, 1000, (1, s)))
    full_core = 2 * 2 * 4 * s * s * 16  # per layer: heads 4, head_dim 16
    assert counter.get_total_flops() == pytest.approx(forward_flops_per_sequence(_cfg(*SHAPE), 1000, s), rel=0.01)
    assert forward_flops_per_sequence(ar, 1000, s) == forward_flops_per_sequence(_cfg(*SHAPE), 1000, s) - full_core


def test_training_is_three_forwards_of_the_megatron_model(megatron_single_process):
    """Forward + backward of the model training builds (megatron-core, local spec), counted."""
    cfg = _cfg(*SHAPE, "model.backend=local")
    model = build_model(cfg, TOKENIZER["vocab_size"], objective=build_objective(cfg.diffusion))
    device = next(model.parameters()).device
    b, s = 2, 64
    tokens = torch.randint(3, TOKENIZER["vocab_size"], (b, s), device=device)
    positions = torch.arange(s, device=device)[None].expand(b, s)
    with FlopCounterMode(display=False) as counter:
        model(tokens, positions, None, labels=tokens).sum().backward()  # per-token CE [b, s]
    expected = training_flops(cfg, TOKENIZER["vocab_size"], [s], micro_batch_size=b)
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.01)


def test_variable_length_steps_add_up():
    cfg = _cfg(*SHAPE, "diffusion.varilen_prob=0.5")
    v, mbs = 1000, 4
    whole = training_flops(cfg, v, [128, 37], mbs)
    assert whole == training_flops(cfg, v, [128], mbs) + training_flops(cfg, v, [37], mbs)
    assert whole == 3 * mbs * (forward_flops_per_sequence(cfg, v, 128) + forward_flops_per_sequence(cfg, v, 37))
    assert training_flops(cfg, v, [], mbs) == 0


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H200", 989),
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA GH200 480GB", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100-PCIE-40GB", 312),
        ("NVIDIA L40S", 362),
        ("NVIDIA L4", 121),
        ("NVIDIA A10G", 70),
        ("NVIDIA B200", 2250),
    ],
)
def test_peak_by_device_name(name, tflops):
    assert peak_flops(name) == pytest.approx(tflops * 1e12)


def test_peak_unknown_cpu_and_override():
    assert peak_flops(None) is None
    assert peak_flops("cpu") is None
    assert peak_flops("Tesla T4") is None  # not in the table: no MFU rather than a guess
    cfg = _cfg("train.peak_tflops=500")
    assert peak_flops("NVIDIA H100 80GB HBM3", cfg.train.peak_tflops) == 500e12  # the override wins
    assert peak_flops(None, cfg.train.peak_tflops) == 500e12
    assert peak_flops("NVIDIA H100 80GB HBM3", load_config(None).train.peak_tflops) == 989e12


def test_efficiency_arithmetic():
    # 2 devices, 3 s, each doing 247.25 TFLOP/s: a quarter of an H100's 989
    out = efficiency(2 * 3 * 247.25e12, 3.0, 2, 989e12)
    assert out["tflops_per_device"] == pytest.approx(247.25)
    assert out["mfu"] == pytest.approx(0.25)
    assert efficiency(1e12, 1.0, 1, None) == {"tflops_per_device": pytest.approx(1.0), "mfu": None}


@pytest.mark.parametrize(
    # the 1B's factor was 1.120 with its former FFN width 5464 (now 5632, a multiple of 128)
    "preset, doc_len, overstated",
    [("125m", 256, 1.257), ("125m", 512, 1.213), ("1b", 512, 1.117)],
)
def test_packed_documents_count_the_attention_they_keep(preset, doc_len, overstated):
    """With document attention the kernels (FlexAttention, THD) skip the cross-document blocks and Megatron-LM
    counts sum L_i^2; counting s^2 overstated MFU by the factors listed above."""
    cfg = _cfg(
        f"model.preset={preset}",
        "diffusion.model_running_mode=difflm-noshift",
        "train.seq_length=2048",
        "model.document_attention=true",
    )
    dense = training_flops(cfg, 50257, [2048], 1)
    packed = training_flops(cfg, 50257, [2048], 1, pairs=[2048 * doc_len])  # 2048/doc_len documents of doc_len
    assert dense / packed == pytest.approx(overstated, abs=5e-4)
    assert training_flops(cfg, 50257, [2048], 1, pairs=[2048 * 2048]) == pytest.approx(dense, rel=1e-12)


def test_document_pairs_sum_the_squared_document_lengths_of_every_row():
    tokens = torch.tensor([[5, 0, 5, 5, 0, 5], [0, 5, 5, 5, 5, 5]])  # EOS (0) ends its own document
    assert document_pairs(document_ids(tokens, 0)) == (2**2 + 3**2 + 1) + (1 + 5**2)
    assert document_pairs(document_ids(torch.full((3, 8), 7), 0)) == 3 * 64


def test_a_training_step_counts_the_document_pairs_of_its_batches(megatron_single_process, tiny_manifest, tmp_path):
    """The trainer hands the FLOPs count each micro-batch's pairs within its documents (fewer than s^2 a row)."""
    cfg = tiny_config(tmp_path, "model.document_attention=true", "train.seq_length=512")
    t, tok = cfg.train, tiny_manifest.tokenizer
    special = SpecialTokens.from_manifest(tok)
    obj = build_objective(cfg.diffusion, special.ids())
    ddp, _, _ = build_training(cfg, tok.vocab_size, objective=obj)
    train_ds, _ = build_datasets(cfg, tiny_manifest, 64 * t.global_batch_size, t.global_batch_size)
    n_micro = t.global_batch_size // t.micro_batch_size

    def micro(step):
        return [micro_batch(train_ds, step, m, 0, cfg, 1, t.seq_length)["tokens"] for m in range(n_micro)]

    # the demo's documents are long: the first step whose windows hold a document boundary
    step = next(s for s in range(64) if any((x == tok.eos_id).any() for x in micro(s)))
    pairs: list[int] = []
    run_global_batch(
        cfg,
        ddp,
        train_ds,
        special,
        step=step,
        noise_step=step,
        forward_only=True,
        attention_pairs=pairs,
        objective=obj,
    )
    assert pairs == [document_pairs(document_ids(x, tok.eos_id)) for x in micro(step)]
    assert all(p <= t.micro_batch_size * t.seq_length**2 for p in pairs)
    assert any(p < t.micro_batch_size * t.seq_length**2 for p in pairs)
    assert training_flops(cfg, tok.vocab_size, [t.seq_length] * n_micro, t.micro_batch_size, pairs) < training_flops(
        cfg, tok.vocab_size, [t.seq_length] * n_micro, t.micro_batch_size
    )


@pytest.mark.parametrize("length", [256, 2048])
def test_complementary_masks_count_the_documents_of_both_rows(length):
    """Complementary masks double the micro-batch: the document pairs of the clean sequences count for both rows,
    so rows of one document each count what they count without documents, as without the option."""

    def ratio(complementary: bool) -> float:
        cfg = _cfg(
            "model.preset=125m",
            "diffusion.model_running_mode=difflm-block",
            f"diffusion.complementary_masks={str(complementary).lower()}",
            "model.document_attention=true",
            f"train.seq_length={length}",
        )
        one_document_each = training_flops(cfg, 4096, [length], 4, pairs=[4 * length * length])
        return one_document_each / training_flops(cfg, 4096, [length], 4)

    assert ratio(True) == pytest.approx(ratio(False), rel=1e-12)
