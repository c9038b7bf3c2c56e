"""Regression tests of the training objectives, each a defect once found: exact values."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_config

from difflm.models.diffusion.modes import build_objective
from difflm.models.megatron.forward_step import SpecialTokens, corrupt
from difflm.models.megatron.hooks import IntervalMeter
from difflm.models.megatron.train import micro_lengths

SPECIAL = SpecialTokens(mask_id=1, vocab_size=50, special_ids=(0, 1, 2), eos_id=0, pad_id=2)


def _batch(x0: torch.Tensor, first: int = 0, loss_mask: torch.Tensor | None = None) -> dict:
    batch = {"tokens": x0, "labels": x0, "positions": torch.arange(first, first + len(x0))}
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    return batch


def _objective(cfg):
    """`cfg`'s objective, built once per test as the trainer builds it once per run."""
    return build_objective(cfg.diffusion, SPECIAL.ids())


def test_masked_tokens_normalisation_does_not_depend_on_the_split():
    """(sum, count) pairs summed over micro-batches give the one-micro-batch loss exactly (6.88 vs 7.88
    before: the mean of per-micro-batch ratios)."""
    cfg = tiny_config(
        "/tmp/unused",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "diffusion.normalize_by=masked_tokens",
        "diffusion.antithetic_t=true",
    )
    x0 = torch.randint(3, 50, (4, 32), generator=torch.Generator().manual_seed(0))
    ce = torch.rand(4, 32, generator=torch.Generator().manual_seed(1)) * 5
    obj = _objective(cfg)

    def terms(rows):
        prep = corrupt(_batch(x0[rows], rows[0]), cfg, SPECIAL, step=3, objective=obj)
        return obj.loss_terms(ce[rows], prep, False)

    whole_sum, whole_count = terms([0, 1, 2, 3])
    (s1, c1), (s2, c2) = terms([0, 1]), terms([2, 3])
    assert whole_count == c1 + c2
    assert math.isclose(whole_sum / whole_count, (s1 + s2) / (c1 + c2), rel_tol=1e-6)
    assert not math.isclose(whole_sum / whole_count, (s1 / c1 + s2 / c2) / 2, rel_tol=1e-3)  # the old reduction


@pytest.mark.parametrize("length", [4, 128])
def test_masked_fraction_weighting_is_an_unbiased_elbo(length):
    """A context-free model with CE 2 at every position has ELBO exactly 2; Bernoulli masking with
    L/#masked weights gave L/(L+1) * 2 (1.60 at L = 4). Exact counts make every row exactly 2."""
    cfg = tiny_config(
        "/tmp/unused",
        "train.global_batch_size=64",
        "train.micro_batch_size=64",
        "diffusion.loss_weighting=masked_fraction",
    )
    x0 = torch.randint(3, 50, (64, length), generator=torch.Generator().manual_seed(0))
    obj = _objective(cfg)
    prep = corrupt(_batch(x0), cfg, SPECIAL, step=11, objective=obj)
    total, count = obj.loss_terms(torch.full((64, length), 2.0), prep, False)
    assert (prep["scored"].sum(-1) >= 1).all()
    assert math.isclose(float(total / count), 2.0, rel_tol=1e-6)


@pytest.mark.parametrize("evaluation", [False, True])
def test_the_datasets_loss_mask_is_never_scored_nor_counted(evaluation):
    """Positions megatron padded (loss_mask 0) carry no data: the loss of a row is that of its valid part."""
    cfg = tiny_config(
        "/tmp/unused",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "diffusion.loss_weighting=masked_fraction",
    )
    x0 = torch.randint(3, 50, (8, 32), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones(8, 32, dtype=torch.bool)
    loss_mask[:, 20:] = False  # megatron's mask is on labels = x[1:]: tokens 21.. are padding, token 20 is data
    ce = torch.full((8, 32), 2.0)
    ce[:, 21:] = 1000.0
    obj = _objective(cfg)
    prep = corrupt(_batch(x0, loss_mask=loss_mask), cfg, SPECIAL, step=5, evaluation=evaluation, objective=obj)
    total, count = obj.loss_terms(ce, prep, evaluation)
    assert int(count) == 8 * 21 and not prep["scored"][:, 21:].any()
    assert math.isclose(float(total / count), 2.0, rel_tol=1e-6)


def test_ar_loss_honours_the_loss_mask():
    cfg = tiny_config("/tmp/unused", "diffusion.model_running_mode=ar")
    x0 = torch.randint(3, 50, (2, 8))
    loss_mask = torch.tensor([[1] * 8, [1] * 4 + [0] * 4], dtype=torch.bool)
    obj = _objective(cfg)
    prep = corrupt(_batch(x0, loss_mask=loss_mask), cfg, SPECIAL, step=0, objective=obj)
    total, count = obj.loss_terms(torch.where(loss_mask, 3.0, 99.0), prep, False)
    assert int(count) == 12 and math.isclose(float(total / count), 3.0)


def test_varilen_draws_a_length_per_micro_batch_for_diffusion_modes_only():
    """One length per micro-batch (as MegaDLMs), full windows for ar, one per step under PP."""
    cfg = tiny_config("/tmp/unused", "diffusion.varilen_prob=1.0", "train.seq_length=64")
    obj = _objective(cfg)
    per_step = [micro_lengths(cfg, step, 4, objective=obj) for step in range(20)]
    assert per_step == [micro_lengths(cfg, step, 4, objective=obj) for step in range(20)]  # reproducible (resume)
    assert any(len(set(lengths)) > 1 for lengths in per_step) and all(2 <= n <= 64 for s in per_step for n in s)
    ar = tiny_config("/tmp/unused", "diffusion.varilen_prob=1.0", "diffusion.model_running_mode=ar")
    assert micro_lengths(ar, 3, 4, objective=_objective(ar)) == [ar.train.seq_length] * 4
    pp = tiny_config(
        "/tmp/unused",
        "diffusion.varilen_prob=1.0",
        "train.seq_length=64",
        "train.launch.nproc_per_node=2",
        "parallel.pipeline_model_parallel_size=2",
    )
    assert all(len(set(micro_lengths(pp, step, 4, objective=_objective(pp)))) == 1 for step in range(20))


def test_logged_loss_is_the_interval_mean_and_throughput_counts_real_tokens():
    """Megatron-style interval averages; a truncated (varilen) step counts only the tokens it ran."""
    meter = IntervalMeter(now=100.0)
    for loss, tokens in [(3.0, 2048), (5.0, 512), (4.0, 2048)]:
        meter.add(loss, tokens)
    assert meter.report(now=102.0) == (4.0, (2048 + 512 + 2048) / 2.0)
    meter.restart(now=200.0)
    meter.add(None, 100)  # a pipeline stage without the loss
    assert meter.report(now=201.0) == (None, 100.0)
