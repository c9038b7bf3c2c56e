"""difflm-block's recipe options: `block_shift` (logit i predicts token i + 1, Fast-dLLM v2 / Dream-style) and
`complementary_masks` (each sequence also trained with its mask's complement): training terms, gradients, the
bound on the same logits, decoding, config and FLOPs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import block_megatron, save_megatron_checkpoint, tiny_config, tiny_hf_model

from difflm.config import load_config
from difflm.models.diffusion.blocks import block_elbo_terms
from difflm.models.diffusion.modes import BlockDiffusion, build_objective
from difflm.models.diffusion.samplers import MaskedSampler
from difflm.models.hf.convert import export_hf, load_hf
from difflm.models.megatron.data import build_datasets
from difflm.models.megatron.flops import training_flops
from difflm.models.megatron.forward_step import SpecialTokens, make_forward_step
from difflm.models.megatron.gpt import build_model
from difflm.models.megatron.train import build_training, run_global_batch

V = 64  # ids 0 eos, 1 mask, 2 pad


def _objective(**over) -> BlockDiffusion:
    return BlockDiffusion(mask_id=1, vocab_size=V, pad_id=2, eos_id=0, **over)


def _prepare(objective, x0, evaluation=False):
    labels = torch.cat([x0[:, 1:], x0[:, :1]], dim=1)  # megatron's: labels[i] = tokens[i + 1]
    return objective.prepare(
        x0,
        labels,
        torch.ones_like(x0, dtype=torch.bool),
        list(range(len(x0))),
        lambda pos: torch.Generator().manual_seed(pos),
        len(x0),
        True,
        evaluation,
    )


def _model(shift: bool = True, clean: str = "block_causal", size: int = 4, seed: int = 0):
    return tiny_hf_model("difflm-block", seed, V, block_size=size, clean_attention=clean, block_shift=shift)


# ---- complementary masks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("weighting", ["inverse_t", "masked_fraction"])
def test_complementary_pair_covers_every_noisy_token_exactly_once(shift, weighting):
    x0 = torch.randint(3, V, (8, 12))
    obj = _objective(block_size=4, complementary_masks=True, block_shift=shift, loss_weighting=weighting)
    prep = _prepare(obj, x0)
    assert prep["inputs"].shape == (16, 24) and obj.rows_per_sequence(False) == 2
    first, second = prep["scored"][:8], prep["scored"][8:]
    noisable = torch.ones_like(first)
    noisable[:, 0] = not shift  # with the shift token 0 is context
    assert not (first & second).any() and torch.equal(first | second, noisable)
    assert torch.equal(prep["inputs"][:8, 12:], x0) and torch.equal(prep["inputs"][8:, 12:], x0)  # clean halves
    assert (prep["weight"] > 0).all() and torch.isfinite(prep["weight"]).all()
    # the bound keeps one mask per sequence: evaluation is the same with and without the option
    ev, plain = _prepare(obj, x0, evaluation=True), _prepare(_objective(block_size=4, block_shift=shift), x0, True)
    assert obj.rows_per_sequence(True) == 1
    for key in ("inputs", "scored", "weight", "loss_weight"):
        assert torch.equal(ev[key], plain[key]), key


def test_complementary_loss_averages_both_masks():
    x0 = torch.randint(3, V, (2, 8))
    obj = _objective(block_size=4, complementary_masks=True)
    prep = _prepare(obj, x0)
    ce = torch.rand(4, 16)
    total, count = obj.loss_terms(ce, prep, False)
    per_row = (ce[:, :8] * prep["scored"] * prep["weight"]).sum(-1)
    assert torch.allclose(total, per_row.sum()) and int(count) == 32  # (m + not m) / 2 per token


# ---- shift --------------------------------------------------------------------------------------------------


def test_shift_puts_each_token_loss_on_the_logit_that_predicts_it():
    """The per-token loss megatron computes on [x_t | x_0] against the targets equals the cross-entropy of the
    aligned logits (what the bound and decoding read) at the masked tokens: training and evaluation agree."""
    L, size = 12, 4
    x0 = torch.randint(3, V, (3, L))
    for shift in (False, True):
        obj = _objective(block_size=size, block_shift=shift)
        prep = _prepare(obj, x0)
        logits = torch.randn(3, 2 * L, V)
        ce = F.cross_entropy(logits.transpose(1, 2), prep["targets"], reduction="none")  # megatron's output
        total, _ = obj.loss_terms(ce, prep, False)
        aligned = F.cross_entropy(obj.align_two_stream(logits).transpose(1, 2), x0, reduction="none")
        assert torch.allclose(total, (aligned * prep["scored"] * prep["weight"]).sum(), rtol=1e-5)
        if shift:  # a block's first token is predicted on the clean half, the others on the noisy half
            assert not prep["scored"][:, 0].any()
            on_clean = prep["loss_weight"][:, L:].nonzero()[:, 1]
            assert ((on_clean + 1) % size == 0).all() and len(on_clean) > 0


@pytest.mark.parametrize("clean", ["block_causal", "token_causal"])
@torch.no_grad()
def test_shifted_logit_of_a_masked_token_never_sees_it(clean):
    model = _model(shift=True, clean=clean)
    L = 12
    x0 = torch.randint(3, V, (1, L))
    xt = torch.where(torch.rand(1, L) < 0.5, torch.ones_like(x0), x0)
    for i in range(1, L):
        xt_i = xt.clone()
        xt_i[0, i] = 1  # token i masked
        other = x0.clone()
        other[0, i] = 3 if x0[0, i] != 3 else 4
        a = model._logits(xt_i, clean=x0)[0, i]
        b = model._logits(xt_i, clean=other)[0, i]
        assert torch.allclose(a, b, atol=1e-6), i


@pytest.mark.parametrize("complementary", [False, True])
def test_shifted_training_loss_is_finite_with_gradients(complementary):
    model = _model(shift=True).train()
    x0 = torch.randint(3, V, (2, 12))
    obj = _objective(block_size=4, block_shift=True, complementary_masks=complementary)
    prep = _prepare(obj, x0)
    L = x0.shape[1]
    logits = model(prep["inputs"][:, :L], clean_ids=prep["inputs"][:, L:]).logits
    ce = F.cross_entropy(logits.transpose(1, 2), prep["targets"], reduction="none")
    total, count = obj.loss_terms(ce, prep, False)
    loss = total / count
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)


@torch.no_grad()
def test_shifted_bound_scores_tokens_from_one_on_the_aligned_logits():
    model = _model(shift=True)
    x0 = torch.randint(3, V, (2, 12))
    got = model.elbo_nll(x0, t_samples=4, generator=torch.Generator().manual_seed(0))
    scored = torch.ones_like(x0, dtype=torch.bool)
    scored[:, 0] = False  # token 0 conditioned on even with prefix_len=0
    ref = block_elbo_terms(
        lambda xt, clean, rows: model.objective.align_two_stream(model(xt, clean_ids=clean).logits),
        x0,
        scored,
        1,
        4,
        4,
        torch.Generator().manual_seed(0),
    )
    assert torch.allclose(got.double(), ref / 11, rtol=1e-5)
    target = torch.ones_like(x0, dtype=torch.bool)
    with pytest.raises(ValueError, match="token 0"):
        model.conditional_nll(x0, target, mc_samples=2)


@pytest.mark.parametrize("clean", ["block_causal", "token_causal"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.no_grad()
def test_shifted_decoding_cached_equals_uncached_and_records_the_shift(clean, temperature):
    model = _model(shift=True, clean=clean)
    prompt = torch.randint(3, V, (2, 5))
    settings = MaskedSampler(steps=8, temperature=temperature, stop_at_eos=False)
    out = {}
    for cache in (True, False):
        stats: dict = {}
        out[cache] = model.block_generate(
            prompt, 10, settings, torch.Generator().manual_seed(5), use_cache=cache, stats=stats
        )
        assert stats["settings"]["block_shift"] is True and stats["settings"]["kv_cache"] == cache
    assert torch.equal(out[True], out[False]) and not (out[True] == 1).any()
    with pytest.raises(ValueError, match="at least one prompt token"):
        model.block_generate(prompt[:, :0], 4, settings)


@torch.no_grad()
def test_shifted_left_padded_batch_equals_one_by_one():
    model = _model(shift=True)
    prompts = [torch.randint(3, V, (n,)) for n in (2, 5, 8)]
    batch = torch.stack([torch.cat([torch.full((8 - len(p),), 2), p]) for p in prompts])
    attn = torch.stack([torch.cat([torch.zeros(8 - len(p)), torch.ones(len(p))]) for p in prompts]).long()
    settings = MaskedSampler(steps=5, stop_at_eos=False)
    for cache in (True, False):
        together = model.block_generate(batch, 7, settings, attention_mask=attn, use_cache=cache)
        for i, p in enumerate(prompts):
            alone = model.block_generate(p[None], 7, settings, use_cache=cache)
            assert torch.equal(together[i, 8:], alone[0, len(p) :]), (i, cache)


@pytest.mark.parametrize("p", [4, 5, 7])
@torch.no_grad()
def test_shifted_greedy_match_is_what_block_decoding_produces(p):
    """Decoding reads the first token of a block from the prompt's / finished block's clean logit, as training
    and the bound do, with training's blocks (a prompt ending inside a block leaves its tail in the first noisy
    block): greedy block decoding's own continuation is a greedy match of the two-stream path."""
    model = _model(shift=True)
    for seed in range(3):
        prompt = torch.randint(3, V, (3, p), generator=torch.Generator().manual_seed(seed))
        seq = model.block_generate(prompt, 8, MaskedSampler(steps=8, stop_at_eos=False))
        target = torch.zeros_like(seq, dtype=torch.bool)
        target[:, p:] = True
        assert model.greedy_match(seq, target).all(), seed
    prompt = prompt[:, :4]
    seq = model.block_generate(prompt, 8, MaskedSampler(steps=8, stop_at_eos=False))
    unshifted = _model(shift=False)  # same weights: the shift changes what decoding produces
    assert not torch.equal(unshifted.block_generate(prompt, 8, MaskedSampler(steps=8, stop_at_eos=False)), seq)


# ---- config, FLOPs, export -------------------------------------------------------------------------------------


def test_config_options_and_flops(tmp_path):
    with pytest.raises(
        Exception, match="block_shift is a setting of difflm-block; model_running_mode is difflm-noshift"
    ):
        load_config("test-tiny", [f"workdir={tmp_path}", "diffusion.block_shift=true"])
    base = ["diffusion.model_running_mode=difflm-block", "diffusion.block_size=4"]
    plain = tiny_config(tmp_path, *base)
    both = tiny_config(tmp_path, *base, "diffusion.complementary_masks=true", "diffusion.block_shift=true")
    both_flops = training_flops(both, 512, [64], 2, objective=build_objective(both.diffusion))
    assert both_flops == 2 * training_flops(plain, 512, [64], 2, objective=build_objective(plain.diffusion))  # two rows


def test_megatron_forward_step_with_both_options(megatron_single_process, tmp_path, tiny_manifest):
    cfg = tiny_config(
        tmp_path,
        "diffusion.model_running_mode=difflm-block",
        "diffusion.block_size=4",
        "model.backend=local",
        "diffusion.block_shift=true",
        "diffusion.complementary_masks=true",
    )
    special = SpecialTokens.from_manifest(tiny_manifest.tokenizer)
    obj = build_objective(cfg.diffusion, special.ids())
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=512, objective=obj).eval()
    x0 = torch.randint(3, 500, (2, 16))
    batch = {
        "tokens": x0,
        "labels": torch.cat([x0[:, 1:], x0[:, :1]], 1),
        "loss_mask": torch.ones(2, 16),
        "positions": torch.tensor([0, 1]),
    }
    output, loss_fn = make_forward_step(cfg, special, step=3, objective=obj)(iter([batch]), model)
    assert output.shape == (4, 32)  # the pair of each sequence, both halves
    total, count, _ = loss_fn(output)
    assert torch.isfinite(total) and total > 0 and int(count) == 2 * 2 * 15  # tokens 1.. of both copies
    output, loss_fn = make_forward_step(cfg, special, step=3, evaluation=True, objective=obj)(iter([batch]), model)
    assert output.shape == (2, 32)  # validation: one mask per sequence (the block ELBO)


def test_export_records_the_shift_and_decodes_with_it(megatron_single_process, tmp_path, tiny_manifest):
    """A shifted block model's export carries `block_shift` (its whole objective, as one entry): its objective,
    bound and decoder read it; the training-only `complementary_masks` changes none of them (one mask)."""
    cfg, model = block_megatron(tmp_path, "local", "diffusion.block_shift=true", "diffusion.complementary_masks=true")
    ckpt = tmp_path / "ckpt"
    save_megatron_checkpoint(model, ckpt)
    hf = load_hf(export_hf(cfg, tiny_manifest.tokenizer.to_dict(), ckpt, tmp_path / "hf").folder)
    assert hf.config.objective["block_shift"] is True and hf.objective.block_shift
    trained = build_objective(cfg.diffusion, SpecialTokens.from_manifest(tiny_manifest.tokenizer).ids())
    assert hf.objective.to_dict() == trained.to_dict()  # the export's own copy of the class: compared as entries
    assert hf.objective.rows_per_sequence(evaluation=True) == 1
    stats: dict = {}
    out = hf.generate_continuation(
        torch.randint(3, 500, (1, 4)), 8, MaskedSampler(steps=8, stop_at_eos=False), stats=stats
    )
    assert out.shape == (1, 12) and stats["settings"]["block_shift"] is True


def test_a_megatron_global_batch_trains_and_validates_with_both_options(
    megatron_single_process, tiny_manifest, tmp_path
):
    """megatron's schedule gets the doubled micro-batch in training (complementary pairs), the plain one in
    validation; both losses finite."""
    cfg = tiny_config(
        tmp_path,
        "diffusion.model_running_mode=difflm-block",
        "diffusion.block_size=4",
        "model.backend=local",
        "diffusion.block_shift=true",
        "diffusion.complementary_masks=true",
    )
    t, tok = cfg.train, tiny_manifest.tokenizer
    special = SpecialTokens.from_manifest(tok)
    obj = build_objective(cfg.diffusion, special.ids())
    ddp, _, _ = build_training(cfg, tok.vocab_size, objective=obj)
    train_ds, _ = build_datasets(cfg, tiny_manifest, 4 * t.global_batch_size, t.global_batch_size)
    for forward_only in (False, True):
        loss = run_global_batch(
            cfg, ddp, train_ds, special, step=0, noise_step=0, forward_only=forward_only, objective=obj
        )
        assert loss is not None and 0 < loss < 100, (forward_only, loss)


@pytest.mark.parametrize("weighting", ["masked_fraction", "inverse_t"])
def test_complementary_pair_averages_to_the_block_elbo(weighting):
    """With a per-token cross-entropy of 1 everywhere the block ELBO per token is exactly 1: the pair's loss must
    be 1 (the exact-count complement used to skip the fully masked block, (2n - 1) / 2n of it)."""
    B, n = 2048, 4  # the exact-count bug gave 0.875: 0.05 tells it apart, at a quarter of the CPU
    x0 = torch.randint(3, 60, (B, n), generator=torch.Generator().manual_seed(0))
    obj = _objective(block_size=n, loss_weighting=weighting, complementary_masks=True)
    prep = _prepare(obj, x0)
    total, count = obj.loss_terms(torch.ones(prep["inputs"].shape), prep, False)
    assert float(total / count) == pytest.approx(1.0, abs=0.05)
