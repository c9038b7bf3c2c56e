"""The kernels a run uses without Transformer Engine (models/megatron/kernels.py): each checked
against the reference path on the CPU where it runs there; the trainer's one all-reduce per step."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from helpers import tiny_config

from difflm.config import MODEL_PRESETS, ConfigError, ModelConfig
from difflm.errors import UserError
from difflm.models.diffusion.modes import build_objective
from difflm.models.megatron import gpt, kernels
from difflm.models.megatron.gpt import build_model
from difflm.models.megatron.train import step_vector


def test_fusions_on_cuda_only_and_as_configured(tmp_path):
    bf16 = tiny_config(tmp_path, "train.precision=bf16")
    assert kernels.kernel_settings(bf16, cuda=False) == kernels.Kernels(False, False, False, "auto")
    assert kernels.kernel_settings(bf16, cuda=True, compiler_ok=True) == kernels.Kernels(True, True, True, "auto")
    fp32 = kernels.kernel_settings(tiny_config(tmp_path), cuda=True, compiler_ok=True)
    assert not fp32.cross_entropy_fusion  # megatron's native fused CE hands back bf16 gradients
    off = kernels.kernel_settings(tiny_config(tmp_path, "train.precision=bf16", "model.fusions=off"), cuda=True)
    assert not (off.swiglu_fusion or off.cross_entropy_fusion or off.fused_adam)
    gelu = kernels.kernel_settings(tiny_config(tmp_path, "model.gated_mlp=false"), cuda=True, compiler_ok=True)
    assert not gelu.swiglu_fusion  # megatron's GELU fusion needs MLP biases, which we do not have
    for act in ("gelu", "gelu_tanh"):  # megatron's GeGLU kernel is the tanh approximation, whichever GELU is set
        geglu = kernels.kernel_settings(tiny_config(tmp_path, f"model.activation={act}"), cuda=True, compiler_ok=True)
        assert not geglu.swiglu_fusion


def test_no_compiler_means_unfused_not_a_failed_first_forward(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "compiler_missing", lambda: "triton is not installed")
    got = kernels.kernel_settings(tiny_config(tmp_path, "train.precision=bf16"), cuda=True)
    assert not (got.swiglu_fusion or got.cross_entropy_fusion) and got.fused_adam
    assert got.compile_unavailable == "triton is not installed"


def test_cuda_settings_make_a_valid_megatron_config(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, "train.precision=bf16", "model.backend=torch")
    monkeypatch.setattr(gpt, "kernel_settings", lambda c: kernels.kernel_settings(c, cuda=True, compiler_ok=True))
    tcfg = gpt.transformer_config(cfg, "torch")
    assert tcfg.bias_activation_fusion and tcfg.cross_entropy_loss_fusion
    assert tcfg.cross_entropy_fusion_impl == "native" and not tcfg.apply_rope_fusion


def _precheck(cfg, gpus=None):
    """The CLI's check of a training command before anything starts (its data and size checks stubbed)."""
    from difflm.flows import prechecks

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prechecks, "_data", lambda c: None)
        mp.setattr(prechecks, "check_fits", lambda c: None)
        mp.setattr(prechecks, "gpu_memory", lambda: gpus)
        prechecks._training(cfg)


def test_cuda_graphs_are_refused_in_one_line_without_cuda(tmp_path):
    """model.cuda_graphs (megatron's per-layer CUDA graphs) on this CPU: one line naming the fix (a UserError: the
    CLI prints it without a traceback), before a local run starts and before any model or RNG tracker is built;
    off is the default and builds as before."""
    from difflm.models.megatron.train import graph_safe_rng

    cfg = tiny_config(tmp_path, "model.cuda_graphs=layers")
    for refuse in (lambda: gpt.transformer_config(cfg), lambda: graph_safe_rng(cfg), lambda: _precheck(cfg)):
        with pytest.raises(UserError, match="no CUDA device: set model.cuda_graphs=off") as err:
            refuse()
        assert "\n" not in str(err.value)
    _precheck(cfg, gpus=80 * 2**30)  # a machine with a GPU: the switch passes the CLI's check
    assert tiny_config(tmp_path).model.cuda_graphs == "off"
    assert gpt.transformer_config(tiny_config(tmp_path)).cuda_graph_impl == "none"
    with pytest.raises(ConfigError, match="cuda_graphs"):
        tiny_config(tmp_path, "model.cuda_graphs=full")


def test_cuda_graphs_reach_megatrons_transformer_config(tmp_path, monkeypatch):
    """On CUDA the switch is megatron's local graphs, whole layers (empty scope), with the rest unchanged."""
    cfg = tiny_config(tmp_path, "model.cuda_graphs=layers")
    monkeypatch.setattr(gpt.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpt, "kernel_settings", lambda c: kernels.kernel_settings(c, cuda=True, compiler_ok=True))
    tcfg = gpt.transformer_config(cfg)
    assert tcfg.cuda_graph_impl == "local" and tcfg.cuda_graph_scope == []
    off = gpt.transformer_config(tiny_config(tmp_path))
    assert off.cuda_graph_impl == "none" and off.num_layers == tcfg.num_layers
    assert kernels.kernel_settings(cfg, cuda=True, compiler_ok=True).describe()["cuda_graphs"] == "layers"


def test_forced_sdpa_backend_is_validated(tmp_path):
    with pytest.raises(RuntimeError, match="CUDA kernel"):
        kernels.check_sdpa("flash", "torch", cuda=False)
    with pytest.raises(RuntimeError, match="model.backend=torch"):
        kernels.check_sdpa("math", "local", cuda=False)
    kernels.check_sdpa("math", "torch", cuda=False)
    kernels.check_sdpa("auto", "local", cuda=False)
    with pytest.raises(ConfigError, match="sdpa_backend"):
        tiny_config(tmp_path, "model.sdpa_backend=fastest")


def test_forced_math_kernel_gives_the_default_attention(tmp_path):
    cfg = tiny_config(tmp_path, "model.sdpa_backend=math")
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with kernels.sdpa_context(cfg.model.sdpa_backend):
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(got, want, atol=1e-6)
    assert kernels.sdpa_choice(cfg, torch.device("cpu"), torch.float32, bidirectional=False) == "MATH"
    auto = tiny_config(tmp_path)
    assert not kernels.sdpa_choice(auto, torch.device("cpu"), torch.float32, True).startswith("error")


def _adam(fused_after: bool):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(33, 7)), torch.nn.Parameter(torch.randn(5))]
    opt = types.SimpleNamespace(optimizer=torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, betas=(0.9, 0.98)))
    kernels.use_fused_adam(opt, fused_after)
    for i in range(3):
        for j, p in enumerate(params):
            p.grad = torch.sin(torch.arange(p.numel(), dtype=torch.float32) * (i + j + 1)).reshape(p.shape)
        opt.optimizer.step()
    return opt, params


def test_fused_adamw_takes_the_foreach_steps():
    (fused_opt, fused), (_, ref) = _adam(True), _adam(False)
    assert fused_opt.optimizer.param_groups[0]["fused"] is True
    for a, b in zip(fused, ref):
        assert torch.allclose(a, b, atol=1e-6)
    # a checkpoint restores step counts on the CPU as plain tensors: fused wants them float32 on the params' device
    state = fused_opt.optimizer.state[fused[0]]
    state["step"] = torch.tensor(3.0, dtype=torch.float64)
    kernels.use_fused_adam(fused_opt, True)
    assert state["step"].dtype == torch.float32
    kernels.use_fused_adam(fused_opt, False)  # back to megatron's default (what a CPU resume of a GPU run gets)
    assert fused_opt.optimizer.param_groups[0]["fused"] is None


def test_gpu_presets_fill_gemm_tiles():
    for name in MODEL_PRESETS:
        model = ModelConfig(preset=name)
        if model.hidden_size >= 640:
            assert model.ffn_size % 128 == 0, name
    with pytest.warns(UserWarning, match="multiple of 128"):
        ModelConfig(preset="1b", ffn_hidden_size=5464)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ModelConfig(preset="small")  # CPU-sized: no warning


def test_step_vector_flags_any_non_finite_gradient_and_sums_the_owned_loss():
    buf = types.SimpleNamespace(grad_data=torch.ones(1000))
    ddp = types.SimpleNamespace(buffers=[buf])
    terms = torch.tensor([6.0, 3.0])
    assert step_vector(ddp, terms, True, False).tolist() == [6.0, 3.0, 0.0, 0.0]
    assert step_vector(ddp, terms, False, True).tolist() == [0.0, 0.0, 0.0, 1.0]  # a TP replica adds no loss
    for bad in (float("nan"), float("inf"), -float("inf")):
        buf.grad_data[517] = bad
        assert step_vector(ddp, None, False, False)[2] > 0
        buf.grad_data[517] = 1.0
    assert step_vector(ddp, torch.tensor([float("nan"), 1.0]), True, False)[2] > 0


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_swiglu_and_fused_cross_entropy_match_the_reference(
    megatron_single_process, tmp_path, monkeypatch, precision
):
    """The CUDA settings run on the CPU too (torch.compile, ~20 s of compiles): same weights, per-token losses
    and gradients as the reference path (CE fusion in bf16 only, as on CUDA)."""
    cfg = tiny_config(
        tmp_path, f"train.precision={precision}", "model.backend=torch", "diffusion.model_running_mode=ar"
    )
    torch.manual_seed(0)
    obj = build_objective(cfg.diffusion)
    ref = gpt.build_model(cfg, 512, objective=obj)
    monkeypatch.setattr(gpt, "kernel_settings", lambda c: kernels.kernel_settings(c, cuda=True, compiler_ok=True))
    fused = gpt.build_model(cfg, 512, objective=obj)
    assert fused.config.bias_activation_fusion and fused.config.cross_entropy_loss_fusion == (precision == "bf16")
    fused.load_state_dict(ref.state_dict())
    x = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24)[None].expand(2, -1)
    losses = []
    for model in (ref, fused):
        loss = model(x, pos, None, labels=torch.roll(x, -1, 1))
        loss.float().mean().backward()
        losses.append(loss.float())
    atol = 1e-5 if precision == "fp32" else 3e-2
    assert (losses[0] - losses[1]).abs().max().item() < atol
    for (name, a), b in zip(ref.named_parameters(), fused.parameters()):
        scale = a.grad.float().abs().max().item() + 1e-6
        assert (a.grad.float() - b.grad.float()).abs().max().item() / scale < (1e-4 if precision == "fp32" else 5e-2), (
            name
        )


def test_rope_table_is_cached_per_length(megatron_single_process, tmp_path):
    """What megatron-core offers for RoPE without Transformer Engine: its cos/sin angle table, computed once per
    sequence length (an lru_cache on RotaryEmbedding.forward), so each forward pays only the rotation itself."""
    cfg = tiny_config(tmp_path, "model.backend=torch")
    model = build_model(cfg, 512, objective=build_objective(cfg.diffusion))
    assert not model.config.apply_rope_fusion  # Transformer Engine's kernel: not available here
    assert model.rotary_pos_emb(24) is model.rotary_pos_emb(24)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_activation_recompute_trains_as_without(megatron_single_process, tmp_path, recompute):
    """model.recompute (megatron's activation recompute, for larger micro-batches in the same memory): the same
    loss and gradients as without it, in training mode, where megatron checkpoints."""
    base = ("model.backend=torch", "diffusion.model_running_mode=ar")
    plain, cfg = tiny_config(tmp_path, *base), tiny_config(tmp_path, *base, f"model.recompute={recompute}")
    torch.manual_seed(0)
    ref = gpt.build_model(plain, 512, objective=build_objective(plain.diffusion))
    again = gpt.build_model(cfg, 512, objective=build_objective(cfg.diffusion))
    assert again.config.recompute_granularity == recompute and ref.config.recompute_granularity is None
    again.load_state_dict(ref.state_dict())
    x = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24)[None].expand(2, -1)
    losses, mlp_calls = [], []
    for model in (ref, again):
        model.train()
        calls = [0]
        model.decoder.layers[0].mlp.register_forward_hook(lambda *_, calls=calls: calls.__setitem__(0, calls[0] + 1))
        loss = model(x, pos, None, labels=torch.roll(x, -1, 1))
        loss.float().mean().backward()
        losses.append(loss.float())
        mlp_calls.append(calls[0])
    assert mlp_calls == [1, 2]  # the backward ran the MLP again: the switch does recompute
    assert torch.allclose(losses[0], losses[1], atol=1e-6)
    for (name, a), b in zip(ref.named_parameters(), again.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["rope", "layers"])
def test_compiled_rope_and_layers_train_as_without(megatron_single_process, tmp_path, setting):
    """model.compile (torch.compile of the elementwise work, no Transformer Engine; Inductor on the CPU here,
    ~20-60 s of compiles): the same loss and gradients as off, to fp32 rounding; the kernels line says so."""
    base = ("model.backend=torch", "diffusion.model_running_mode=ar")
    torch._dynamo.utils.counters.clear()
    plain = tiny_config(tmp_path, *base)
    torch.manual_seed(0)
    ref = gpt.build_model(plain, 512, objective=build_objective(plain.diffusion))
    cfg = tiny_config(tmp_path, *base, f"model.compile={setting}")
    again = gpt.build_model(cfg, 512, objective=build_objective(cfg.diffusion))
    assert kernels.kernel_settings(cfg).describe()["compile"] == setting
    again.load_state_dict(ref.state_dict())
    x = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24)[None].expand(2, -1)
    losses = []
    for model in (ref, again):
        loss = model(x, pos, None, labels=torch.roll(x, -1, 1))
        loss.float().mean().backward()
        losses.append(loss.float())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # something was compiled
    assert (losses[0] - losses[1]).abs().max().item() < 1e-5
    for (name, a), b in zip(ref.named_parameters(), again.parameters()):
        scale = a.grad.abs().max().item() + 1e-6
        assert (a.grad - b.grad).abs().max().item() / scale < 1e-4, name
