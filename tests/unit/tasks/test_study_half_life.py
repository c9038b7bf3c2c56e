"""The data-reuse half-life R*: points drawn from L = E_inf + A / D'(U, E)^ALPHA with a known R* and a little noise
are fitted back; where the points cannot tell R* from infinity, or are too few, the fit says so."""

import numpy as np
import pytest

from difflm.config import StudySpec
from difflm.flows.study import _report
from difflm.tasks.study import ALPHA, effective_tokens, fit_half_life, half_lives, write_table

EPOCHS = [1, 2, 4, 8, 16, 32, 60]  # the CPU preset's shape: up to about 60 epochs
NOISE = 0.01  # nats/token: the spread of a small model's held-out NLL between seeds


def _rows(r_star, epochs=EPOCHS, seed=0, family="f", budget=50_000, size="preset", noise=NOISE):
    rng = np.random.default_rng(seed)
    scale = 2.0 * budget**ALPHA  # 2 nats above E_inf at one epoch: L falls from about 5 to 4
    return [
        {
            "family": family,
            "kind": "diffusion",
            "unique_tokens": budget,
            "epochs": e,
            "size": size,
            "validation_nll": round(
                3.0 + scale / effective_tokens(budget, e, r_star) ** ALPHA + rng.normal(0, noise), 4
            ),
            "status": "ran train",
        }
        for e in epochs
    ]


def test_effective_tokens_follow_the_papers_form():
    assert effective_tokens(100, 1, 15) == 100  # one epoch: all fresh
    assert effective_tokens(100, 0.5, 15) == 100  # no repeats below one epoch
    assert effective_tokens(100, 16, 15) == pytest.approx(100 + 100 * 15 * (1 - np.exp(-1)))
    assert effective_tokens(100, 60, 15) < 100 * 16  # saturates at U (1 + R*)
    assert effective_tokens(100, 60, float("inf")) == 6000  # every repeat as good as fresh


@pytest.mark.parametrize("seed", range(5))
def test_a_short_half_life_is_fitted_back_within_30_percent(seed):
    fit = fit_half_life(_rows(15, seed=seed), "ar")
    assert fit.r_star == pytest.approx(15, rel=0.3) and fit.points == len(EPOCHS)
    assert fit.line().startswith("data-reuse half-life: R* = 1") and fit.line().endswith("(fit on 7 points)")


@pytest.mark.parametrize("seed", range(5))
def test_a_half_life_past_the_epochs_tried_is_reported_as_a_lower_bound(seed):
    # R* = 500 over at most 60 epochs: D' is within 6% of all-fresh, the noise hides the difference
    fit = fit_half_life(_rows(500, seed=seed), "masked")
    assert fit.r_star is None and fit.above == 60
    assert "greater than the largest epochs tried (60" in fit.line() and fit.tag() == ">60"


def test_a_long_half_life_is_fitted_when_the_epochs_reach_past_it():
    epochs = [1, 4, 16, 64, 256, 1024, 4096]
    fit = fit_half_life(_rows(500, epochs=epochs, noise=0.002), "masked")
    assert fit.r_star == pytest.approx(500, rel=0.3)


def test_budgets_share_r_star_with_a_scale_each():
    rows = _rows(15, budget=20_000) + _rows(15, epochs=[1, 2], budget=500_000, seed=1)
    assert fit_half_life(rows, "ar").r_star == pytest.approx(15, rel=0.3)
    # a budget seen at one length only says nothing of R*: left out, whatever its loss
    control = _rows(15, epochs=[1], budget=5_000_000) + [
        {**_rows(15, epochs=[0.5], budget=4_000_000)[0], "validation_nll": 2.0}
    ]
    fit = fit_half_life(rows + control, "ar")
    assert fit.r_star == fit_half_life(rows, "ar").r_star and fit.points == len(rows)


def test_too_few_epochs_above_one_give_no_half_life_and_say_why():
    fit = fit_half_life(_rows(15, epochs=[1, 2, 4]), "ar")
    assert fit.r_star is None and fit.above is None
    assert fit.line() == "data-reuse half-life: absent (needs 3 epochs above 1; has 2)"
    assert fit.tag() == "absent: needs 3 epochs above 1; has 2"
    # a failed point is no point: 3 epochs above 1 in the grid, 2 finished
    rows = _rows(15, epochs=[1, 2, 4, 8])
    rows[-1] = {**rows[-1], "validation_nll": "", "status": "failed: RuntimeError: x"}
    assert half_lives(rows)[0].reason == "needs 3 epochs above 1; has 2"


def test_a_loss_that_only_rises_with_epochs_has_no_half_life():
    rows = [{**r, "validation_nll": 4.0 + 0.01 * r["epochs"]} for r in _rows(15)]  # overfits from the start
    assert fit_half_life(rows, "ar").reason == "the validation loss does not fall as the data grows"


def test_one_line_per_family_and_size_in_the_markdown(tmp_path):
    rows = _rows(15, family="ar") + _rows(15, epochs=[1, 4], family="masked") + _rows(15, family="ar", size="m")
    fits = half_lives(rows)
    assert [f.label for f in fits] == ["ar/m", "ar/preset", "masked/preset"]
    _, md_path = write_table(rows, tmp_path)
    md = md_path.read_text()
    assert "ar/preset: data-reuse half-life: R* = " in md and "ar/m: data-reuse half-life: R* = " in md
    assert "masked/preset: data-reuse half-life: absent (needs 3 epochs above 1; has 1)" in md
    assert half_lives(_rows(15))[0].label == "f"  # one size: the family's name alone


def test_the_study_report_carries_the_half_life_per_family(tmp_path):
    spec = StudySpec(families={"ar": [], "masked": []}, unique_tokens=[50_000], epochs=EPOCHS)
    rows = _rows(15, family="ar") + _rows(500, family="masked")
    summary = _report(spec, rows, tmp_path, None)
    assert summary["half_life"]["ar"].startswith("data-reuse half-life: R* = ")
    assert summary["half_life"]["masked"].startswith("data-reuse half-life: R* greater than the largest epochs")
    assert "masked: data-reuse half-life: R* greater" in (tmp_path / "results.md").read_text()
