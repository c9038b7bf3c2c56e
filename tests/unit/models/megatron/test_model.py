"""The megatron-core model on CPU (gloo, one process): attention modes and the HF export's logits."""

from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from megatron.core import dist_checkpointing

from difflm.config import load_config
from difflm.models import diffusion
from difflm.models.diffusion.arch import ModelArch
from difflm.models.diffusion.modes import build_objective
from difflm.models.hf.convert import ConversionError, export_hf, import_hf, load_hf
from difflm.models.hf.export import Export
from difflm.models.megatron.gpt import build_model


def _model(mode: str, tmp_path, **over):
    extra = [f"{k}={v}" for k, v in over.items()]
    cfg = tiny_config(tmp_path, f"diffusion.model_running_mode={mode}", *extra)
    torch.manual_seed(0)
    return cfg, build_model(cfg, vocab_size=512, objective=build_objective(cfg.diffusion)).eval()


def _logits(model, x, t=None):
    pos = torch.arange(x.shape[1]).unsqueeze(0).expand_as(x)
    with torch.no_grad():
        return model(x, pos, None, t=t) if t is not None else model(x, pos, None)  # [b, s, v]


@pytest.mark.parametrize("mode, sees_future", [("difflm-noshift", True), ("ar", False)])
def test_attention_direction(megatron_single_process, tmp_path, mode, sees_future):
    _, model = _model(mode, tmp_path)
    x = torch.randint(3, 500, (2, 16))
    y = x.clone()
    y[:, -1] = (y[:, -1] + 7) % 500  # perturb only the last token
    moved = (_logits(model, x)[:, 0] - _logits(model, y)[:, 0]).abs().max().item()
    assert (moved > 1e-4) == sees_future


def _save_model_only(model, path: Path):
    path.mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(prefix="")}, str(path))


@pytest.mark.parametrize(
    "mode, over",
    [
        ("difflm-noshift", {}),
        ("ar", {}),
        ("difflm-shift", {}),
        ("difflm-noshift-uniform", {}),
        ("difflm-noshift", {"diffusion.time_embedding": "true"}),  # adaLN in every layer (the default)
        ("difflm-noshift-uniform", {"diffusion.time_embedding": "true", "model.normalization": "LayerNorm"}),
        ("difflm-noshift", {"diffusion.time_embedding": "true", "diffusion.time_conditioning": "input"}),
        (
            "difflm-noshift",
            {
                "model.num_query_groups": 1,
                "model.qk_layernorm": "true",
                "model.gated_mlp": "false",
                "model.normalization": "LayerNorm",
                "model.tie_embeddings": "false",
            },
        ),
        (  # an imported Qwen2/Qwen3's features: q/k/v bias, qk-norm, a head width apart from hidden/heads
            "difflm-shift",
            {
                "model.qkv_bias": "true",
                "model.qk_layernorm": "true",
                "model.kv_channels": 24,
                "model.num_query_groups": 1,
            },
        ),
        (  # Gemma's: GELU-tanh gated MLP, (1 + w) norms (the q/k norms too), embeddings x sqrt(hidden)
            "difflm-noshift",
            {
                "model.activation": "gelu_tanh",
                "model.norm_offset": 1,
                "model.embedding_scale": "true",
                "model.qk_layernorm": "true",
                "model.kv_channels": 24,
                "diffusion.time_embedding": "true",
                "diffusion.time_conditioning": "input",
            },
        ),
        ("ar", {"model.activation": "gelu", "model.normalization": "LayerNorm", "model.norm_offset": 1}),
    ],
)
def test_hf_export_gives_megatron_logits(megatron_single_process, tmp_path, tiny_manifest, mode, over):
    cfg, model = _model(mode, tmp_path, **over)
    with torch.no_grad():  # move weights off their init so norms/biases are not all ones/zeros
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ckpt = tmp_path / "ckpt"
    _save_model_only(model, ckpt)
    tok = tiny_manifest.tokenizer.to_dict()
    out = export_hf(cfg, tok, ckpt, tmp_path / "hf")
    assert out == Export.read(tmp_path / "hf") and (out.format, out.mode, out.parity) == (
        "difflm",
        cfg.diffusion.model_running_mode,
        None,
    )
    hf = load_hf(out.folder)
    x = torch.randint(3, 500, (2, 24))
    t = torch.tensor([0.3, 0.8]) if cfg.diffusion.time_embedding else None
    ref = _logits(model, x, t)
    got = hf(x, t=t).logits
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()
    assert hf.config.bidirectional == (mode != "ar")
    # the architecture record, whole, in config.json (the flat fields of older exports are no longer written)
    assert hf.config.architecture == ModelArch.of(cfg.model).to_dict() and "gated_mlp" not in hf.config.to_dict()
    assert hf.config.time_embedding == cfg.diffusion.time_embedding
    if mode == "difflm-noshift" and not over:  # padding-aware ELBO: all-ones mask = no mask
        seeded = lambda: torch.Generator().manual_seed(0)  # noqa: E731
        full = hf.elbo_nll(x, generator=seeded())
        assert torch.allclose(full, hf.elbo_nll(x, attention_mask=torch.ones_like(x), generator=seeded()), atol=1e-5)


@pytest.mark.parametrize("conditioning", ["adaln", "input"])
def test_time_embedding_conditions_the_output(megatron_single_process, tmp_path, conditioning):
    cfg, model = _model(
        "difflm-noshift", tmp_path, **{"diffusion.time_embedding": "true", "diffusion.time_conditioning": conditioning}
    )
    modulated = [n for n, _ in model.named_parameters() if "modulation" in n]
    assert bool(modulated) == (conditioning == "adaln") and (model.time_embedding is None) == bool(modulated)
    x = torch.randint(3, 500, (1, 16))
    same = _logits(model, x, torch.tensor([0.2]))
    assert torch.allclose(same, _logits(model, x, torch.tensor([0.9])))  # zero-initialised: no effect yet
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_2.weight" in name:  # the zero-initialised output layer of each time MLP
                p.normal_(0, 0.5)
    assert not torch.allclose(_logits(model, x, torch.tensor([0.2])), _logits(model, x, torch.tensor([0.9])))
    with pytest.raises(ValueError, match="pass t"):
        _logits(model, x)


def test_conversion_rejects_a_non_checkpoint(tmp_path, tiny_manifest):
    with pytest.raises(ConversionError, match="not a megatron distributed checkpoint"):
        export_hf(load_config("test-tiny"), tiny_manifest.tokenizer.to_dict(), tmp_path, tmp_path / "hf")


@pytest.mark.parametrize("mode", ["difflm-noshift", "ar"])
def test_packed_documents_do_not_see_each_other(megatron_single_process, tmp_path, tiny_manifest, mode):
    cfg, model = _model(mode, tmp_path, **{"model.document_attention": "true"})
    eos = tiny_manifest.tokenizer.eos_id
    x = torch.randint(3, 500, (1, 20))
    x[0, 7] = eos  # document 0 = positions 0..7, document 1 = 8..19
    mask = diffusion.document_attention_mask(diffusion.document_ids(x, eos), causal=mode == "ar")
    pos = torch.arange(20)[None]
    with torch.no_grad():
        base = model(x, pos, mask)
        y = x.clone()
        y[0, 15] = (y[0, 15] + 5) % 500  # change a token of document 1 only
        other = model(y, pos, mask)
    assert torch.allclose(base[0, :8], other[0, :8], atol=1e-6)  # document 0 cannot see it
    if mode != "ar":
        assert not torch.allclose(base[0, 8:15], other[0, 8:15], atol=1e-4)  # document 1 (bidirectional) does

    ckpt = tmp_path / "ckpt"
    _save_model_only(model, ckpt)
    hf = load_hf(export_hf(cfg, tiny_manifest.tokenizer.to_dict(), ckpt, tmp_path / "hf").folder)
    got = hf(x, document_ids=diffusion.document_ids(x, eos)).logits
    assert torch.allclose(got, base, atol=1e-4)


def test_sequence_parallel_on_the_local_spec_says_what_to_do(megatron_single_process, tmp_path):
    cfg = load_config(
        "test-tiny",
        [
            f"workdir={tmp_path}",
            "parallel.tensor_model_parallel_size=2",
            "train.launch.nproc_per_node=2",
            "parallel.sequence_parallel=true",
            "model.backend=local",  # (auto picks torch, which supports it)
        ],
    )
    with pytest.raises(RuntimeError, match="model.backend=torch"):
        build_model(cfg, 512, objective=build_objective(cfg.diffusion))


@pytest.mark.parametrize("extra", [[], ["diffusion.time_embedding=true"]], ids=["plain", "adaln"])
def test_import_repads_the_vocabulary_for_the_target_layout(megatron_single_process, tmp_path, tiny_manifest, extra):
    """3,871 tokens pad to 3,904 rows at TP=1 and 3,968 at TP=2; an export from one layout imports
    for the other (the check compares the true vocabulary, the rows are cut or zero-padded)."""
    tok = {**tiny_manifest.tokenizer.to_dict(), "vocab_size": 3871}
    cfg = tiny_config(tmp_path, *extra)
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=3871, objective=build_objective(cfg.diffusion))
    _save_model_only(model, tmp_path / "ckpt")
    hf = export_hf(cfg, tok, tmp_path / "ckpt", tmp_path / "hf").folder
    source = model.embedding.word_embeddings.weight.detach()
    assert source.shape[0] == 3904
    for tp, rows in [(2, 3968), (1, 3904)]:
        target = tiny_config(
            tmp_path, f"parallel.tensor_model_parallel_size={tp}", f"train.launch.nproc_per_node={tp}", *extra
        )
        ckpt = import_hf(target, hf, tmp_path / f"tp{tp}", tok)
        meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
        assert meta["embedding.word_embeddings.weight"].global_shape[0] == rows
        loaded = dist_checkpointing.load({k: v for k, v in meta.items() if k.startswith("embedding.")}, str(ckpt))
        emb = loaded["embedding.word_embeddings.weight"]
        assert torch.equal(emb[:3871], source[:3871]) and not emb[3904:].any()


def test_zero_centred_norms_refuse_adaln(megatron_single_process, tmp_path):
    """adaLN norms take their scale from t: a (1 + w) norm has no place to go, so the build says so."""
    with pytest.raises(RuntimeError, match="norm_offset=1 with diffusion.time_conditioning=adaln"):
        _model("difflm-noshift", tmp_path, **{"model.norm_offset": 1, "diffusion.time_embedding": "true"})


def test_old_exports_flat_fields_read_as_the_record():
    """config.json of an export written before the record: its flat fields give the same switches."""
    old = {"gated_mlp": False, "hidden_act": "gelu", "normalization": "LayerNorm", "qk_layernorm": True}
    assert ModelArch.from_hf_config({**old, "qkv_bias": True, "head_dim": 24}) == ModelArch(
        gated_mlp=False, activation="gelu", normalization="LayerNorm", qk_norm=True, qkv_bias=True, head_dim=24
    )
    assert ModelArch.from_hf_config({}) == ModelArch()  # the defaults of then: SwiGLU, RMSNorm
    record = ModelArch(activation="gelu_tanh", norm_offset=1, embedding_scale=True)
    assert ModelArch.from_hf_config({"architecture": record.to_dict(), "hidden_act": "silu"}) == record


def test_ar_keeps_the_padding_rows_out_of_its_loss(megatron_single_process, tmp_path):
    """500 tokens in 512 rows: in `ar` the 12 padding rows get -inf, so the loss is the cross-entropy over the 500
    tokens and its gradients stay finite; a diffusion mode's logits keep every row (its losses are unchanged)."""
    x = torch.randint(3, 500, (2, 16))
    pos = torch.arange(16)[None].expand(2, 16)
    for mode in ("ar", "difflm-noshift"):
        cfg = tiny_config(tmp_path, f"diffusion.model_running_mode={mode}")
        torch.manual_seed(0)
        model = build_model(cfg, vocab_size=500, objective=build_objective(cfg.diffusion))
        logits = model(x, pos, None)
        assert torch.isinf(logits[..., 500:]).all() == (mode == "ar") and torch.isfinite(logits[..., :500]).all()
    cfg = tiny_config(tmp_path, "diffusion.model_running_mode=ar")
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=500, objective=build_objective(cfg.diffusion))
    loss = model(x, pos, None, labels=x).float()
    want = torch.nn.functional.cross_entropy(
        model(x, pos, None)[..., :500].flatten(0, 1), x.flatten(), reduction="none"
    )
    assert torch.allclose(loss.flatten(), want, atol=1e-5)
    loss.mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_an_output_transform_runs_before_the_padding_rows_go_to_minus_inf(megatron_single_process, tmp_path):
    """A transform of the logits (here Gemma 2's soft cap, cap * tanh(x / cap), which maps -inf to -cap) runs
    before the `ar` padding rows are set to -inf, whatever order it was added in: they stay -inf, the token rows
    are the transform's. A forward hook registered on the output layer after the model's own is refused."""
    x = torch.randint(3, 500, (2, 16))
    pos = torch.arange(16)[None].expand(2, 16)
    cfg = tiny_config(tmp_path, "diffusion.model_running_mode=ar")
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=500, objective=build_objective(cfg.diffusion))
    plain = model(x, pos, None).detach()
    cap = 2.0
    model.add_output_transform(lambda logits: cap * torch.tanh(logits / cap))
    model.add_output_transform(lambda logits: logits / 0.5)  # a temperature, after the cap
    capped = model(x, pos, None).detach()
    assert torch.isinf(capped[..., 500:]).all() and (capped[..., 500:] < 0).all()
    assert torch.allclose(capped[..., :500], cap * torch.tanh(plain[..., :500] / cap) / 0.5, atol=1e-6)

    handle = model.output_layer.register_forward_hook(lambda _m, _a, out: out)
    with pytest.raises(RuntimeError, match="add it with add_output_transform"):
        model(x, pos, None)
    handle.remove()
    assert torch.equal(model(x, pos, None), capped)
