"""The GPU path: the device rule of the forward step, the `torch` backend (SDPA / FlexAttention core attention)
against megatron's local spec, backend choice. (The one-shot GPU check's own tests: test_gpu_check.py.)

Tests marked `gpu` need CUDA and are skipped without it; `benchmarks/gpu_check.py` runs them on a GPU. The rest
runs on the CPU, where the torch spec runs too (SDPA; dense masks instead of FlexAttention, which has no CPU
backward)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_config

from difflm.models.diffusion.modes import build_objective

ROOT = Path(__file__).resolve().parents[2]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (mode, overrides): bidirectional and causal, grouped-query attention with qk norms, adaLN time conditioning,
# packed documents both ways
# (ids: gpu_check runs the `documents` cases, FlexAttention compiles on CUDA, after everything else)
CASES = [
    pytest.param("difflm-noshift", [], id="bidirectional"),
    pytest.param("ar", [], id="causal"),
    pytest.param("difflm-noshift", ["model.num_query_groups=1", "model.qk_layernorm=true"], id="mqa-qknorm"),
    pytest.param("difflm-noshift", ["diffusion.time_embedding=true"], id="time"),
    pytest.param("difflm-noshift", ["model.document_attention=true", "model.num_query_groups=1"], id="documents-mqa"),
    pytest.param("ar", ["model.document_attention=true"], id="documents-causal"),
]


def _pair(tmp_path, mode: str, over: list[str], device: str, dtype=torch.float32):
    """The same weights in the local spec and the torch spec."""
    from difflm.models.megatron.gpt import build_model

    cfgs = [
        tiny_config(tmp_path, f"diffusion.model_running_mode={mode}", f"model.backend={b}", *over)
        for b in ("local", "torch")
    ]
    torch.manual_seed(0)
    objective = build_objective(cfgs[0].diffusion)  # the same objective: only the spec differs
    local = build_model(cfgs[0], 512, objective=objective).to(device=device, dtype=dtype).eval()
    torched = build_model(cfgs[1], 512, objective=objective).to(device=device, dtype=dtype).eval()
    assert set(local.state_dict()) == set(torched.state_dict())  # checkpoints are interchangeable
    torched.load_state_dict(local.state_dict())
    return cfgs[1], local, torched


def _inputs(cfg, device: str):
    from difflm.models import diffusion
    from difflm.models.megatron.attention import DocumentMask

    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, 500, (2, 24), generator=g)
    x[:, 9] = 0  # an EOS: two packed documents per row
    x, pos = x.to(device), torch.arange(24, device=device)[None].expand(2, -1)
    kw = {"t": torch.rand(2, generator=g).to(device)} if cfg.diffusion.time_embedding else {}
    if not cfg.model.document_attention:
        return x, pos, None, None, kw
    causal = cfg.diffusion.model_running_mode == "ar"
    doc = diffusion.document_ids(x, 0)
    return x, pos, diffusion.document_attention_mask(doc, causal), DocumentMask(doc, causal), kw


def _compare(tmp_path, mode, over, device: str, dtype, atol: float) -> None:
    cfg, local, torched = _pair(tmp_path, mode, over, device, dtype)
    x, pos, dense, doc_mask, kw = _inputs(cfg, device)
    with torch.no_grad():
        want = local(x, pos, dense, **kw).float()
        got = torched(x, pos, doc_mask, **kw).float()
    assert type(torched.decoder.layers[0].self_attention.core_attention).__name__ == "TorchCoreAttention"
    assert (got - want).abs().max().item() < atol


@pytest.mark.parametrize("mode, over", CASES)
def test_torch_spec_gives_the_local_spec_logits(megatron_single_process, tmp_path, mode, over):
    _compare(tmp_path, mode, over, "cpu", torch.float32, 1e-5)  # measured ~1e-7


def test_torch_spec_trains_with_documents_on_the_cpu(megatron_single_process, tmp_path):
    """Gradients flow through the torch spec's packed-document path (dense mask to SDPA on the CPU)."""
    cfg, local, torched = _pair(tmp_path, "difflm-noshift", ["model.document_attention=true"], "cpu")
    x, pos, dense, doc_mask, _ = _inputs(cfg, "cpu")
    local(x, pos, dense).float().square().mean().backward()
    torched(x, pos, doc_mask).float().square().mean().backward()
    for (name, a), b in zip(local.named_parameters(), torched.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


class _Recorder(torch.nn.Module):
    """Stands in for the model: one parameter on `device`, records where each input tensor lives."""

    def __init__(self, device: str):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, device=device))
        self.devices: dict = {}

    def forward(self, input_ids, position_ids, attention_mask, labels=None, **kwargs):
        from difflm.models.megatron.attention import DocumentMask

        mask = attention_mask.doc_ids if isinstance(attention_mask, DocumentMask) else attention_mask
        packed = kwargs.pop("packed_seq_params", None)
        if packed is not None:  # THD: the boundaries are tensors too
            kwargs["cu_seqlens"] = packed.cu_seqlens_q
        self.shapes = {"input_ids": input_ids.shape, "labels": None if labels is None else labels.shape}
        for name, value in {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "attention_mask": mask,
            "labels": labels,
            **kwargs,
        }.items():
            if value is not None:
                self.devices[name] = value.device
        return torch.zeros(input_ids.shape, device=self.weight.device)


@pytest.mark.parametrize("backend", ["local", "torch"])
@pytest.mark.parametrize("mode", ["difflm-noshift", "ar", "difflm-noshift-uniform"])
def test_forward_step_inputs_land_on_the_model_device(tmp_path, mode, backend):
    """The device rule: batches and noise are made on the CPU; the step moves every tensor to the model's
    device. The meta device stands in for a GPU here (a CPU tensor left behind stays on 'cpu')."""
    from difflm.models.megatron.forward_step import SpecialTokens, make_forward_step

    cfg = tiny_config(
        tmp_path,
        f"diffusion.model_running_mode={mode}",
        f"model.backend={backend}",
        "model.document_attention=true",
        "diffusion.time_embedding=true",
    )
    special = SpecialTokens(mask_id=1, vocab_size=512, special_ids=(0, 1, 2), eos_id=0, pad_id=2)
    x = torch.randint(3, 500, (4, 32))
    batch = {
        "tokens": x,
        "labels": torch.roll(x, -1, 1),
        "loss_mask": torch.ones_like(x, dtype=torch.float),
        "positions": torch.arange(4),
    }
    model = _Recorder("meta")
    objective = build_objective(cfg.diffusion, special.ids())
    output, loss_func = make_forward_step(cfg, special, step=3, objective=objective)(iter([batch]), model)
    expected = (
        {"input_ids", "position_ids", "attention_mask"}
        | ({"t"} if mode != "ar" else set())
        | ({"labels"} if mode != "difflm-noshift-uniform" else set())
    )
    assert set(model.devices) == expected
    assert all(d.type == "meta" for d in model.devices.values()), model.devices
    assert loss_func.args[0]["scored"].device.type == "meta"  # what the loss reads is there too


def test_backend_choice(monkeypatch):
    from difflm.models.megatron import backend

    assert backend.resolve_backend("torch") == "torch"
    assert backend.resolve_backend("local") == "local"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # the torch spec gives the local spec's logits (test_torch_spec_gives_the_local_spec_logits) and trains
    # faster on the CPU too: it is the default everywhere without Transformer Engine
    assert backend.resolve_backend("auto") == "torch"
    assert backend.resolve_backend("auto", two_stream=True) == "torch"
    with pytest.raises(RuntimeError, match="model.backend=torch"):
        backend.resolve_backend("te")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend, "transformer_engine_available", lambda: False)
    assert backend.resolve_backend("auto") == "torch"  # a GPU without Transformer Engine


# ---- packed documents as THD sequences (Transformer Engine's form), tested on the torch spec -----------------
def _special():
    from difflm.models.megatron.forward_step import SpecialTokens

    return SpecialTokens(mask_id=1, vocab_size=512, special_ids=(0, 1, 2), eos_id=0, pad_id=2)


def _packed_batch() -> dict:
    """Three rows of 24 with every document shape: EOS inside and as the last token, a row without EOS, an
    EOS first (a one-token document)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(3, 500, (3, 24), generator=g)
    x[0, 9] = x[0, 23] = 0
    x[2, 0] = x[2, 15] = 0
    return {
        "tokens": x,
        "labels": torch.roll(x, -1, 1),
        "loss_mask": torch.ones_like(x, dtype=torch.float),
        "positions": torch.arange(3),
    }


def test_packed_documents_cu_seqlens():
    from difflm.models import diffusion
    from difflm.models.megatron.forward_step import packed_documents

    x = torch.tensor(
        [
            [5, 5, 0, 6, 6, 6],  # EOS inside: [5 5 EOS] [6 6 6]
            [7, 7, 7, 7, 7, 7],  # no EOS: the row is one sequence
            [8, 0, 9, 9, 9, 0],  # EOS as the last token ends its document, nothing empty follows
            [0, 4, 4, 0, 0, 4],
        ]
    )  # EOS first: a one-token document; two EOS in a row end one document (an SFT EOS fill is its conversation's)
    cu, longest = packed_documents(diffusion.document_ids(x, 0))
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 6, 12, 14, 18, 19, 23, 24]
    assert longest == 6
    cu, longest = packed_documents(diffusion.document_ids(torch.full((1, 7), 3), 0))
    assert cu.tolist() == [0, 7] and longest == 7  # one row, no EOS: one sequence
    cu, _ = packed_documents(diffusion.document_ids(torch.tensor([[3, 0], [0, 3]]), 0))
    assert cu.tolist() == [0, 2, 3, 4]  # a document never crosses a row boundary


def test_document_form_per_backend(tmp_path):
    from megatron.core.transformer.enums import AttnMaskType

    from difflm.models.megatron.forward_step import document_form
    from difflm.models.megatron.gpt import layer_spec

    assert document_form("te") == "thd"
    assert document_form("torch") == "flex"
    assert document_form("local") == "dense"
    assert document_form("te", pipeline_parallel=2, micro_batch_size=1) == "thd"  # p2p [s, 1, h] = [b*s, 1, h]
    assert document_form("te", pipeline_parallel=2, micro_batch_size=2) == "dense"  # p2p shapes [s, b, h]
    model = tiny_config(tmp_path, "model.document_attention=true").model

    def mask(backend, bidirectional, documents=None):
        return layer_spec(model, bidirectional, backend, documents=documents).submodules.self_attention.params[
            "attn_mask_type"
        ]

    assert mask("local", True) == AttnMaskType.arbitrary  # the dense [b, 1, s, s] mask
    assert mask("torch", True, "dense") == AttnMaskType.arbitrary
    # DocumentMask / THD carry the documents; the spec carries the direction (TE: padding / padding_causal)
    assert mask("torch", True) == mask("torch", True, "thd") == AttnMaskType.no_mask
    assert mask("torch", False, "thd") == AttnMaskType.causal


TIME_INPUT = ["diffusion.time_embedding=true", "diffusion.time_conditioning=input"]
THD_CASES = [
    ("difflm-noshift", []),
    ("difflm-noshift", TIME_INPUT),
    ("ar", []),
    ("ar", TIME_INPUT),
    ("difflm-noshift-uniform", TIME_INPUT),
]  # uniform: the step gets logits [1, b*s, V], not CE


def _document_models(tmp_path, mode: str, over: list[str], device: str = "cpu", dtype=torch.float32):
    """The local and torch specs with document attention on the same weights, the time embedding randomised
    (it starts at zero, which would hide a wrong per-token expansion)."""
    cfg, local, torched = _pair(tmp_path, mode, ["model.document_attention=true", *over], device, dtype)
    if local.time_embedding is not None:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in local.time_embedding.parameters():
                p.copy_(torch.randn(p.shape, generator=g).to(p) * 0.5)
        torched.load_state_dict(local.state_dict())
    return cfg, local, torched


def _step_outputs(cfg, model, documents: str, batch: dict, grad: bool = False):
    """(raw output, [b, s(, V)] output, loss sum) of the forward step with packed documents in `documents` form."""
    from difflm.models.megatron.forward_step import make_forward_step

    with torch.set_grad_enabled(grad):
        step = make_forward_step(
            cfg, _special(), step=2, documents=documents, objective=build_objective(cfg.diffusion, _special().ids())
        )
        out, loss_func = step(iter([batch]), model)
        total, count, _ = loss_func(out)
    b, s = batch["tokens"].shape
    return out, out.reshape(b, s, *out.shape[2:]), total, count


@pytest.mark.parametrize("mode, over", THD_CASES)
def test_thd_packed_sequences_give_the_document_mask_losses(megatron_single_process, tmp_path, mode, over):
    """Transformer Engine's form (one row [1, b*s], one sequence per document, RoPE restarted per sequence)
    gives the per-token loss / logits of the DocumentMask path and of the local spec's dense mask."""
    cfg, local, torched = _document_models(tmp_path, mode, over)
    batch = _packed_batch()
    _, dense, dense_total, count = _step_outputs(cfg, local, "dense", batch)
    _, flex, flex_total, _ = _step_outputs(cfg, torched, "flex", batch)
    raw, thd, thd_total, thd_count = _step_outputs(cfg, torched, "thd", batch)
    assert raw.shape[:2] == (1, 72)  # megatron's output under THD: one row
    assert (flex - dense).abs().max().item() < 1e-5
    assert (thd - dense).abs().max().item() < 1e-5
    assert (thd - flex).abs().max().item() < 1e-5
    assert abs(thd_total.item() - dense_total.item()) < 1e-4 * abs(dense_total.item()) and thd_count == count
    assert abs(flex_total.item() - dense_total.item()) < 1e-4 * abs(dense_total.item())


@pytest.mark.parametrize("mode", ["difflm-noshift", "ar"])
def test_thd_logits_equal_the_dense_mask_logits(megatron_single_process, tmp_path, mode):
    """The model itself: logits [1, b*s, V] under THD, reshaped, are the local spec's with the dense mask."""
    from difflm.models import diffusion
    from difflm.models.megatron.forward_step import packed_seq_params

    over = TIME_INPUT if mode != "ar" else []
    cfg, local, torched = _document_models(tmp_path, mode, over)
    x = _packed_batch()["tokens"]
    b, s = x.shape
    doc = diffusion.document_ids(x, 0)
    pos = torch.arange(s)[None].expand(b, -1)
    kw = {"t": torch.tensor([0.2, 0.5, 0.9])} if over else {}
    with torch.no_grad():
        want = local(x, pos, diffusion.document_attention_mask(doc, causal=mode == "ar"), **kw)
        got = torched(
            x.reshape(1, -1),
            pos.reshape(1, -1),
            None,
            packed_seq_params=packed_seq_params(doc, torch.device("cpu")),
            **kw,
        )
    assert got.shape == (1, b * s, want.shape[-1])
    assert (got.reshape(want.shape) - want).abs().max().item() < 1e-5


def test_thd_gradients_equal_the_dense_mask_gradients(megatron_single_process, tmp_path):
    """Backward through THD (per-document RoPE, the per-row time embedding) gives the dense path's gradients."""
    cfg, local, torched = _document_models(tmp_path, "difflm-noshift", TIME_INPUT)
    batch = _packed_batch()
    _, _, dense_total, _ = _step_outputs(cfg, local, "dense", batch, grad=True)
    _, _, thd_total, _ = _step_outputs(cfg, torched, "thd", batch, grad=True)
    dense_total.backward()
    thd_total.backward()
    for (name, a), b in zip(local.named_parameters(), torched.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name
    assert torched.time_embedding.linear_2.weight.grad.abs().sum() > 0


def test_thd_forward_step_flattens_rows_onto_the_model_device(tmp_path):
    """The THD step hands the model one row [1, b*s], no mask, int32 boundaries and t [b], all on its device."""
    from difflm.models.megatron.forward_step import make_forward_step

    cfg = tiny_config(tmp_path, "model.backend=torch", "model.document_attention=true", *TIME_INPUT)
    batch = _packed_batch()
    model = _Recorder("meta")
    objective = build_objective(cfg.diffusion, _special().ids())
    output, loss_func = make_forward_step(cfg, _special(), step=3, documents="thd", objective=objective)(
        iter([batch]), model
    )
    assert set(model.devices) == {"input_ids", "position_ids", "labels", "t", "cu_seqlens"}
    assert all(d.type == "meta" for d in model.devices.values()), model.devices
    assert model.shapes == {"input_ids": (1, 72), "labels": (1, 72)}
    assert output.shape == (1, 72)


# ---- on a GPU ---------------------------------------------------------------------------------------------
@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mode, over", CASES)
def test_cuda_torch_spec_gives_the_local_spec_logits(megatron_single_process, tmp_path, mode, over):
    """fp32: SDPA / FlexAttention against megatron's unfused softmax; bf16: within bf16 rounding."""
    torch.backends.cuda.matmul.allow_tf32 = False
    _compare(tmp_path, mode, over, "cuda", torch.float32, 1e-4)
    _compare(tmp_path, mode, over, "cuda", torch.bfloat16, 0.15)


@cuda
@pytest.mark.gpu
def test_cuda_flex_attention_document_mask_matches_dense_with_gradients():
    from difflm.models import diffusion
    from difflm.models.megatron.attention import DocumentMask, _flex_attention

    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, 500, (2, 256), generator=g)
    x[:, [40, 130, 200]] = 0
    doc = diffusion.document_ids(x, 0).cuda()
    for causal in (False, True):
        mask = DocumentMask(doc, causal)
        q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", requires_grad=True) for _ in range(3))
        got = _flex_attention()(q, k, v, block_mask=mask.block_mask())
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense_keep())
        assert (got - want).abs().max().item() < 1e-4
        grads = torch.autograd.grad(got.sum(), (q, k, v))
        ref = torch.autograd.grad(want.sum(), (q, k, v))
        assert all((a - b).abs().max().item() < 1e-3 for a, b in zip(grads, ref))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("token_causal", [False, True], ids=["block-causal", "token-causal"])
def test_cuda_flex_attention_block_mask_matches_dense_with_gradients(token_causal):
    """Block diffusion's [x_t | x_0] mask on FlexAttention (the compiled block mask the GPU trains with) against
    SDPA with the dense keep mask, packed documents included: outputs and the gradients of q, k and v."""
    from difflm.models import diffusion
    from difflm.models.megatron.attention import TwoStreamMask, _flex_attention

    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, 500, (2, 128), generator=g)
    x[:, [30, 90]] = 0
    doc = diffusion.document_ids(x, 0).cuda()
    mask = TwoStreamMask(128, 4, token_causal, doc)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", requires_grad=True) for _ in range(3))
    got = _flex_attention()(q, k, v, block_mask=mask.block_mask())
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense_keep())
    assert (got - want).abs().max().item() < 1e-4
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    ref = torch.autograd.grad(want.sum(), (q, k, v))
    assert all((a - b).abs().max().item() < 1e-3 for a, b in zip(grads, ref))


@cuda
@pytest.mark.gpu
def test_cuda_forward_step_runs_on_the_gpu(megatron_single_process, tmp_path):
    """A real megatron model on the GPU takes the step's batch (made on the CPU) without a device error."""
    from difflm.models.megatron.forward_step import SpecialTokens, make_forward_step
    from difflm.models.megatron.gpt import build_model

    cfg = tiny_config(tmp_path, "model.backend=torch", "diffusion.time_embedding=true")
    special = SpecialTokens(mask_id=1, vocab_size=512, special_ids=(0, 1, 2), eos_id=0, pad_id=2)
    objective = build_objective(cfg.diffusion, special.ids())
    model = build_model(cfg, 512, objective=objective).cuda()
    x = torch.randint(3, 500, (4, 32))
    batch = {
        "tokens": x,
        "labels": torch.roll(x, -1, 1),
        "loss_mask": torch.ones_like(x, dtype=torch.float),
        "positions": torch.arange(4),
    }
    output, loss_func = make_forward_step(cfg, special, step=0, objective=objective)(iter([batch]), model)
    total, count, _ = loss_func(output)
    assert output.is_cuda and torch.isfinite(total) and count > 0


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["difflm-noshift", "ar"])
def test_cuda_thd_on_the_torch_spec_gives_the_dense_mask_losses(megatron_single_process, tmp_path, mode):
    """On CUDA the THD sequences become a FlexAttention block mask; fp32 losses within 1e-4 of the dense path."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg, local, torched = _document_models(tmp_path, mode, TIME_INPUT if mode != "ar" else [], "cuda")
    batch = _packed_batch()
    _, dense, _, _ = _step_outputs(cfg, local, "dense", batch)
    _, thd, _, _ = _step_outputs(cfg, torched, "thd", batch)
    assert (thd - dense).abs().max().item() < 1e-4


def _te_available() -> bool:
    from difflm.models.megatron.backend import transformer_engine_available

    return torch.cuda.is_available() and transformer_engine_available()


te = pytest.mark.skipif(not _te_available(), reason="needs CUDA and Transformer Engine")


@te
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["difflm-noshift", "ar"])
def test_cuda_te_thd_keeps_documents_apart(megatron_single_process, tmp_path, mode):
    """Transformer Engine's THD path: each document's output equals the document run alone (RoPE is relative),
    and the step's loss is finite. bf16: TE's fused kernels take half precision."""
    from difflm.models import diffusion
    from difflm.models.megatron.forward_step import packed_seq_params
    from difflm.models.megatron.gpt import build_model

    cfg = tiny_config(
        tmp_path,
        f"diffusion.model_running_mode={mode}",
        "model.backend=te",
        "model.document_attention=true",
        "train.precision=bf16",
    )
    model = build_model(cfg, 512, objective=build_objective(cfg.diffusion)).cuda().eval()
    batch = _packed_batch()
    x = batch["tokens"].cuda()
    b, s = x.shape
    with torch.no_grad():
        packed = model(
            x.reshape(1, -1),
            torch.arange(s, device="cuda").repeat(b)[None],
            None,
            packed_seq_params=packed_seq_params(diffusion.document_ids(batch["tokens"], 0), x.device),
        )
        packed = packed.reshape(b, s, -1).float()
        for row, (start, end) in [(0, (0, 10)), (0, (10, 24)), (1, (0, 24)), (2, (1, 16))]:
            alone = model(x[row : row + 1, start:end], torch.arange(end - start, device="cuda")[None], None).float()
            assert (packed[row, start:end] - alone[0]).abs().max().item() < 0.15, (row, start, end)
    _, _, total, count = _step_outputs(cfg, model, "thd", batch)
    assert torch.isfinite(total) and count > 0
