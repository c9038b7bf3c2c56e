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
def test_a_short_half_life_is_fitted_back_within_30_percent_inside_its_interval(seed):
    fit = fit_half_life(_rows(15, seed=seed), "ar")
    assert fit.r_star == pytest.approx(15, rel=0.3) and fit.points == len(EPOCHS)
    assert fit.low < 15 < fit.high and fit.high / fit.low < 3  # the points pin it down: a bounded interval
    assert fit.line().startswith("data-reuse half-life: R* = 1") and fit.line().endswith("; fit on 7 points)")
    assert "(95% interval " in fit.line() and fit.tag().startswith(f"{fit.r_star:.4g} [")


@pytest.mark.parametrize("seed", range(5))
def test_a_half_life_past_the_epochs_tried_is_reported_as_a_lower_bound(seed):
    # R* = 500 over at most 60 epochs: D' is within 6% of all-fresh, the noise hides the difference; the small R*
    # that would bend the curve within the points are ruled out
    fit = fit_half_life(_rows(500, seed=seed), "masked")
    assert fit.high is None and 20 < fit.low < 500
    assert "R* above " in fit.line() and "no upper bound" in fit.line() and fit.tag() == f">{fit.low:.3g}"


def test_points_that_fit_any_half_life_say_not_identified():
    """docs/study.md's masked-diffusion points (review 4, S1): 4 points, 3 unknowns, non-monotone; R* = 0.5 fits
    them almost as well as R* = 10,000, so the line says so rather than "R* greater than the epochs tried"."""
    nll = {2: 7.2165, 6: 7.1755, 20: 7.2616, 60: 7.0591}
    rows = [
        {"family": "masked", "unique_tokens": 48000, "epochs": e, "validation_nll": v, "epochs_seen": e + 0.02}
        for e, v in nll.items()
    ]
    fit = fit_half_life(rows, "masked")
    assert fit.low is None and fit.high is None and fit.tag() == "not identified"
    assert fit.line().startswith("data-reuse half-life: not identified by these points (any R* from 0.1 to 10,000")


def test_a_long_half_life_is_fitted_when_the_epochs_reach_past_it():
    epochs = [1, 4, 16, 64, 256, 1024, 4096]
    fit = fit_half_life(_rows(500, epochs=epochs, noise=0.002), "masked")
    assert fit.r_star == pytest.approx(500, rel=0.3) and fit.low < 500 < fit.high


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
    assert fit.r_star is None and fit.low is None and fit.high is None
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
    assert summary["half_life"]["masked"].startswith("data-reuse half-life: R* above ")
    assert "masked: data-reuse half-life: R* above " in (tmp_path / "results.md").read_text()
