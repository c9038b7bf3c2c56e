"""Exact tests of the pure diffusion maths and the sampler."""

import math

import pytest
import torch
from helpers import tiny_config

from difflm.models import diffusion
from difflm.models.diffusion.modes import build_objective, objective_from_dict
from difflm.models.diffusion.samplers import MaskedSampler, sample_masked_diffusion, timestep_count, unmask_schedule
from difflm.models.megatron.forward_step import SpecialTokens, corrupt, varilen_length


def test_sample_t_range_and_antithetic_bins():
    g = torch.Generator().manual_seed(0)
    t = diffusion.sample_t(10_000, 0.01, g)
    assert t.min() >= 0.01 and t.max() <= 1.0
    assert abs(t.mean().item() - (0.01 + 0.99 / 2)) < 0.01
    ta = diffusion.sample_t(8, 0.0, torch.Generator().manual_seed(1), antithetic=True)
    bins = (ta * 8).floor().long()
    assert bins.tolist() == list(range(8))  # one draw in each stratum


def test_mask_rate_matches_t():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(3, 100, (4, 20_000))
    t = torch.tensor([0.1, 0.3, 0.6, 0.9])
    xt, masked = diffusion.mask_tokens(x0, t, mask_id=1, generator=g)
    rates = masked.float().mean(1)
    assert torch.allclose(rates, t, atol=0.01)
    assert torch.equal(xt[masked], torch.ones_like(xt[masked]))
    assert torch.equal(xt[~masked], x0[~masked])


def test_loss_weighting_and_normalisation_exact():
    ce = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    masked = torch.tensor([[True, False, True, False], [False, False, False, True]])
    t = torch.tensor([0.5, 0.25])
    # all tokens: (1/0.5*(1+3) + 1/0.25*8) / 8 = (8 + 32) / 8
    assert math.isclose(diffusion.masked_diffusion_loss(ce, masked, t).item(), 5.0)
    # masked tokens: 40 / 3
    assert math.isclose(
        diffusion.masked_diffusion_loss(ce, masked, t, normalize_by="masked_tokens").item(), 40 / 3, rel_tol=1e-6
    )
    # no weighting: (1+3+8)/8
    assert math.isclose(diffusion.masked_diffusion_loss(ce, masked, t, weighting="none").item(), 1.5)


def test_elbo_of_uniform_model_is_log_vocab():
    vocab = 50
    uniform = lambda x: torch.zeros(*x.shape, vocab)  # noqa: E731
    x0 = torch.randint(2, vocab, (64, 32))
    nll = diffusion.elbo_nll_per_token(uniform, x0, mask_id=1, t_samples=16, generator=torch.Generator().manual_seed(0))
    # the discrete-form estimator has zero variance here: every sample gives exactly log V
    assert torch.allclose(nll, torch.full_like(nll, math.log(vocab)), rtol=1e-5)


def test_mask_exactly_masks_the_requested_count():
    x0 = torch.randint(3, 50, (5, 40))
    counts = torch.tensor([1, 7, 20, 39, 40])
    xt, masked = diffusion.mask_exactly(x0, counts, 1, torch.Generator().manual_seed(0))
    assert masked.sum(-1).tolist() == counts.tolist() and (xt[masked] == 1).all()


def test_elbo_estimators_agree_on_a_context_free_model():
    """For a model whose prediction ignores the context, the bound is the mean CE, whatever the estimator."""
    vocab = 12
    table = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    logits_fn = lambda x: table.expand(*x.shape, vocab)  # noqa: E731
    x0 = torch.randint(2, vocab, (16, 24))
    exact = diffusion.token_cross_entropy(logits_fn(x0), x0).mean()
    nll = diffusion.elbo_nll_per_token(logits_fn, x0, 1, 32, torch.Generator().manual_seed(0))
    assert abs(nll.mean().item() - exact.item()) < 0.03 * exact.item()


def test_elbo_is_zero_for_a_perfect_model():
    vocab = 20
    x0 = torch.randint(2, vocab, (4, 16))
    perfect = lambda x: torch.nn.functional.one_hot(x0, vocab).float() * 100  # noqa: E731
    nll = diffusion.elbo_nll_per_token(perfect, x0, mask_id=1, t_samples=4)
    assert nll.max().item() < 1e-6


def test_unmask_schedule_covers_length():
    assert unmask_schedule(10, 4) == [3, 3, 2, 2]
    assert sum(unmask_schedule(7, 100)) == 7


def test_sampler_keeps_prompt_and_fills_every_mask():
    vocab, mask_id = 30, 1
    prompt = torch.tensor([[5, 6, 7]])
    logits_fn = lambda x: torch.randn(*x.shape, vocab, generator=torch.Generator().manual_seed(x.sum().item()))  # noqa
    out = sample_masked_diffusion(
        logits_fn, prompt, length=9, mask_id=mask_id, steps=3, vocab_limit=vocab, forbidden_ids=(0,)
    )
    assert out.shape == (1, 12)
    assert torch.equal(out[:, :3], prompt)
    assert not (out == mask_id).any() and not (out[:, 3:] == 0).any()


def test_sampler_commits_most_confident_first():
    vocab, mask_id = 10, 1

    # position 2 of the continuation is very confident about token 7; others are unsure
    def logits_fn(x):
        logits = torch.zeros(*x.shape, vocab)
        logits[:, 3, 7] = 10.0
        return logits

    prompt = torch.tensor([[4]])
    seen = []

    def recording(x):
        seen.append(x.clone())
        return logits_fn(x)

    sample_masked_diffusion(recording, prompt, length=4, mask_id=mask_id, steps=4)
    assert seen[1][0, 3].item() == 7  # committed at the first step


def test_left_to_right_remasking_commits_the_leftmost_masks_whatever_the_confidence():
    """llama.cpp's order at --top-k 1 (its confidences tie): the next `k` masked positions, here 2 a step."""
    vocab, mask_id = 10, 1

    def logits_fn(x):
        logits = torch.zeros(*x.shape, vocab)
        logits[:, -1, 7] = 10.0  # the last position is the surest: low_confidence would commit it first
        return logits

    seen = []
    settings = MaskedSampler(steps=3, remasking="left_to_right", stop_at_eos=False)
    sample_masked_diffusion(lambda x: seen.append(x.clone()) or logits_fn(x), torch.tensor([[4]]), 6, mask_id, 3,
                            settings=settings)  # fmt: skip
    assert [int((x[0, 1:] == mask_id).sum()) for x in seen] == [6, 4, 2]
    assert (seen[1][0, 1:3] != mask_id).all() and (seen[2][0, 1:5] != mask_id).all()
    with pytest.raises(ValueError, match="left_to_right remasking has none"):
        MaskedSampler(remasking="left_to_right", threshold=0.9)


def test_timestep_schedule_is_dreams_and_commits_everything_by_the_last_step():
    """Dream's eps schedule (llama.cpp's --diffusion-eps): int(masked (1 - s/t)) of the masked, all at the end."""
    counts, masked = [], 20
    for step in range(4):
        k = timestep_count(step, 4, masked, 1e-3)
        counts.append(k)
        masked -= k
    assert counts == [4, 5, 5, 6] and masked == 0  # t: 1, 0.75, 0.5, 0.25 -> shares 1/4, 1/3, 1/2, all
    assert timestep_count(0, 8, 3, 1e-3) == 0  # int(3 / 8): a step may commit nothing
    seen = []
    settings = MaskedSampler(steps=4, eps=1e-3, stop_at_eos=False)
    out = sample_masked_diffusion(lambda x: seen.append(x.clone()) or torch.randn(*x.shape, 9), torch.tensor([[4]]),
                                  20, 1, 4, settings=settings)  # fmt: skip
    assert [int((x == 1).sum()) for x in seen] == [20, 16, 11, 6] and not (out == 1).any()
    with pytest.raises(ValueError, match="eps is Dream's final timestep"):
        MaskedSampler(eps=0.0)


def test_uniform_noise_stays_in_the_non_special_vocabulary():
    allowed = torch.arange(3, 40)  # ids 0..2 are special
    x0 = torch.randint(3, 40, (8, 500))
    t = torch.full((8,), 0.7)
    xt, corrupted = diffusion.uniform_corrupt(x0, t, allowed, torch.Generator().manual_seed(0))
    assert xt.min() >= 3 and xt.max() < 40
    assert abs(corrupted.float().mean().item() - 0.7) < 0.02
    assert torch.equal(xt[~corrupted], x0[~corrupted])
    assert (xt[corrupted] != x0[corrupted]).float().mean() > 0.9  # replaced by (mostly) other tokens


def test_shift_targets_score_the_next_masked_token():
    x0 = torch.tensor([[10, 11, 12, 13]])
    masked = torch.tensor([[True, True, False, True]])
    targets, scored = diffusion.shift_targets(x0, masked)
    assert targets[0, :3].tolist() == [11, 12, 13]
    assert scored.tolist() == [[True, False, True, False]]  # position 3 has no next token


def test_masked_fraction_weighting():
    ce = torch.ones(2, 4)
    masked = torch.tensor([[True, False, False, False], [True, True, True, True]])
    t = torch.tensor([0.9, 0.9])  # ignored by this weighting
    # weights 4/1 and 4/4: (4*1 + 1*4) / 8
    assert math.isclose(diffusion.masked_diffusion_loss(ce, masked, t, weighting="masked_fraction").item(), 1.0)


def test_per_token_weights_are_a_weighting_of_their_own():
    """Any objective's per-token weights go in as weighting="per_token" (CART's are one kind); weights given with
    a per-sequence weighting, or a weighting the function does not know, are an error rather than ignored."""
    ce = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    masked = torch.tensor([[True, False, True, True]])
    t, weights = torch.tensor([0.5]), torch.tensor([[0.5, 9.0, 2.0, 1.0]])
    total, count = diffusion.masked_diffusion_loss_terms(ce, masked, t, "per_token", token_weights=weights)
    assert float(total) == 1.0 * 0.5 + 3.0 * 2.0 + 4.0 * 1.0 and int(count) == 4
    with pytest.raises(ValueError, match="per_token needs token_weights"):
        diffusion.masked_diffusion_loss_terms(ce, masked, t, "per_token")
    with pytest.raises(ValueError, match="token_weights are read with weighting=per_token"):
        diffusion.masked_diffusion_loss_terms(ce, masked, t, "inverse_t", token_weights=weights)
    with pytest.raises(ValueError, match="'cart': a per-sequence one of"):  # once the only way in; no silent 1
        diffusion.masked_diffusion_loss_terms(ce, masked, t, "cart", token_weights=None)


def test_a_config_of_cart_weighs_each_token_by_its_cart_weight(tmp_path):
    """loss_weighting=cart, as configs, run directories and exports of before hold it: the objective loads and
    trains per token with the CART weights, the same numbers as before the weighting had its own name."""
    cfg = tiny_config(tmp_path, "diffusion.model_running_mode=difflm-shift", "diffusion.loss_weighting=cart")
    special = SpecialTokens(mask_id=1, vocab_size=50, special_ids=(0, 1, 2))
    obj = build_objective(cfg.diffusion, special.ids())
    assert obj.loss_weighting == "cart" and obj.training_weighting() == "per_token"
    assert objective_from_dict(obj.to_dict(), special.ids()) == obj  # an export's entry reads back
    x0 = torch.randint(3, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": x0, "labels": torch.roll(x0, -1, 1), "positions": torch.arange(4)}
    prep = corrupt(batch, cfg, special, step=2, objective=obj)
    ce = torch.rand(4, 16, generator=torch.Generator().manual_seed(1))
    total, count = obj.loss_terms(ce, prep, False)
    assert torch.allclose(total, (ce * prep["scored"] * prep["token_weights"]).sum()) and total > 0
    assert int(count) == int(prep["valid"].sum())


def test_noise_does_not_depend_on_the_micro_batch_split():
    cfg = tiny_config(
        "/tmp/unused", "train.global_batch_size=4", "train.micro_batch_size=2", "diffusion.antithetic_t=true"
    )
    special = SpecialTokens(mask_id=1, vocab_size=50, special_ids=(0, 1, 2))
    x0 = torch.randint(3, 50, (4, 16))
    obj = build_objective(cfg.diffusion, special.ids())
    whole = corrupt({"tokens": x0, "labels": x0, "positions": torch.arange(4)}, cfg, special, step=5, objective=obj)
    halves = [
        corrupt(
            {"tokens": x0[i : i + 2], "labels": x0[i : i + 2], "positions": torch.arange(i, i + 2)},
            cfg,
            special,
            step=5,
            objective=obj,
        )
        for i in (0, 2)
    ]
    assert torch.equal(whole["inputs"], torch.cat([h["inputs"] for h in halves]))
    assert torch.equal(whole["t"], torch.cat([h["t"] for h in halves]))
    assert sorted((whole["t"] * 4).floor().long().tolist()) == [0, 1, 2, 3]  # antithetic over the global batch
    other_step = corrupt(
        {"tokens": x0, "labels": x0, "positions": torch.arange(4)}, cfg, special, step=6, objective=obj
    )
    assert not torch.equal(whole["inputs"], other_step["inputs"])


def test_varilen_length_is_reproducible_and_divisible():
    lengths = [varilen_length(7, step, 128, 0.5, multiple=4) for step in range(400)]
    assert lengths == [varilen_length(7, step, 128, 0.5, multiple=4) for step in range(400)]
    short = [n for n in lengths if n < 128]
    assert 0.4 < len(short) / len(lengths) < 0.6
    assert all(n % 4 == 0 and 4 <= n <= 128 for n in lengths)
    assert varilen_length(7, 3, 128, 0.0) == 128


def test_document_ids_and_mask():
    x0 = torch.tensor([[5, 6, 0, 7, 0, 8]])  # eos = 0 ends documents 0 and 1
    doc = diffusion.document_ids(x0, eos_id=0)
    assert doc.tolist() == [[0, 0, 0, 1, 1, 2]]
    blocked = diffusion.document_attention_mask(doc, causal=False)[0, 0]
    assert not blocked[0, 2] and blocked[0, 3] and blocked[5, 4] and not blocked[4, 3]
    causal = diffusion.document_attention_mask(doc, causal=True)[0, 0]
    assert causal[0, 1] and not causal[1, 0]


def test_evaluation_noise_masks_exact_counts_and_scores_the_elbo():
    cfg = tiny_config("/tmp/unused", "train.global_batch_size=4", "train.micro_batch_size=4")
    special = SpecialTokens(mask_id=1, vocab_size=50, special_ids=(0, 1, 2))
    x0 = torch.randint(3, 50, (4, 32))
    obj = build_objective(cfg.diffusion, special.ids())
    batch = {"tokens": x0, "labels": x0, "positions": torch.arange(4)}
    prep = corrupt(batch, cfg, special, step=-1, evaluation=True, objective=obj)
    counts = prep["scored"].sum(-1)
    assert torch.equal(counts, (prep["t"] * 32).ceil().long())
    assert sorted((prep["t"] * 4).floor().long().tolist()) == [0, 1, 2, 3]  # always stratified in evaluation
    ce = torch.full((4, 32), 2.0)  # a context-free model with CE 2 everywhere: the ELBO is exactly 2
    total, count = obj.loss_terms(ce, prep, True)
    assert math.isclose((total / count).item(), 2.0, rel_tol=1e-6)


def test_elbo_ignores_padding():
    vocab = 20
    table = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    logits_fn = lambda x: table.expand(*x.shape, vocab)  # noqa: E731 - context-free: bound = mean CE
    x0 = torch.randint(3, vocab, (1, 6))
    padded = torch.cat([x0, torch.zeros(1, 10, dtype=torch.long)], dim=1)
    valid = torch.cat([torch.ones(1, 6), torch.zeros(1, 10)], dim=1).bool()
    exact = diffusion.token_cross_entropy(logits_fn(x0), x0).mean()
    got = diffusion.elbo_nll_per_token(logits_fn, padded, 1, 64, torch.Generator().manual_seed(0), valid)
    assert abs(got.item() - exact.item()) < 0.05 * exact.item()
