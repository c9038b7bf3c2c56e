"""The study spec: a grid of families x budgets x epochs x sizes expands to one checked config per point; a bad
spec is one line saying what to fix."""

from pathlib import Path

import pytest

from difflm.config import ConfigError
from difflm.config.study import load_study

SPEC = """
name: smoke
preset: test-tiny
base: [train.eval_iters=1]
families:
  masked: [diffusion.model_running_mode=difflm-noshift]
  ar-mir: [diffusion.model_running_mode=ar, diffusion.mir_mask_share=0.25, diffusion.mir_weight=0.4]
unique_tokens: [1000, 4000]
epochs: [1, 2.5]
sizes: [tiny, null]
parallel: 2
"""


def _spec(tmp_path, text):
    path = tmp_path / "study.yaml"
    path.write_text(text)
    return path


def test_a_grid_expands_to_every_point_with_its_overrides(tmp_path):
    spec = load_study(_spec(tmp_path, SPEC))
    points = spec.points()
    assert len(points) == 2 * 2 * 2 * 2 and spec.parallel == 2
    labels = [p.label for p in points]
    assert len(set(labels)) == len(labels) and "ar-mir-tiny-u4000-e2.5" in labels and "masked-u1000-e1" in labels
    p = next(p for p in points if p.label == "ar-mir-tiny-u4000-e2.5")
    assert p.overrides == [
        "train.eval_iters=1",
        "diffusion.model_running_mode=ar",
        "diffusion.mir_mask_share=0.25",
        "diffusion.mir_weight=0.4",
        "data.unique_tokens=4000",
        "train.epochs=2.5",
        "model.preset=tiny",
    ]
    cfg = p.cfg
    assert cfg.data.unique_tokens == 4000 and cfg.train.epochs == 2.5 and cfg.model.preset == "tiny"
    assert cfg.diffusion.model_running_mode == "ar" and cfg.diffusion.mir_weight == 0.4 and cfg.train.eval_iters == 1
    assert spec.output_dir(cfg) == Path(cfg.workdir) / "studies" / "smoke"


@pytest.mark.parametrize(
    "change, says",
    [
        ("families: {}", "families: Dictionary should have at least 1 item"),
        ("unique_tokens: [1000, 1000]", "unique_tokens: must be distinct positive token counts"),
        ("epochs: [0]", "epochs: must be distinct positive numbers of epochs"),
        ("name: ../x", "name: name '../x' must be letters"),
        ("parallel: 0", "parallel: Input should be greater than or equal to 1"),
        ("budgets: [1]", "budgets: unknown field (fields: name, preset,"),
        ("base: [train.epochs=3]", "base: base sets train.epochs, which the grid sets: list it under epochs"),
        ("base: [nokey]", "base: override 'nokey' is not of the form key.sub=value"),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_field(tmp_path, change, says):
    key = change.split(":")[0]
    lines = [line for line in SPEC.splitlines() if not line.startswith(key) and not line.startswith("  ")]
    if key != "families":
        lines += ["families:", "  masked: [diffusion.model_running_mode=difflm-noshift]"]
    with pytest.raises(ConfigError) as err:
        load_study(_spec(tmp_path, "\n".join([*lines, change])))
    assert "\n" not in str(err.value) and says in str(err.value), str(err.value)


def test_a_missing_field_says_what_it_is(tmp_path):
    with pytest.raises(ConfigError, match=r"study.yaml: epochs: missing: The lengths in epochs"):
        load_study(_spec(tmp_path, "families: {a: []}\nunique_tokens: [1000]\n"))


def test_a_point_whose_config_is_bad_is_named(tmp_path):
    spec = load_study(_spec(tmp_path, SPEC.replace("diffusion.mir_weight=0.4", "diffusion.mir_wieght=0.4")))
    with pytest.raises(ConfigError) as err:
        spec.points()
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("study smoke, point ar-mir-tiny-u1000-e1: invalid configuration:"), str(err.value)


def test_the_shipped_study_specs_expand():
    specs = sorted((Path(__file__).resolve().parents[3] / "configs" / "studies").glob("*.yaml"))
    assert {p.stem for p in specs} >= {"demo", "cpu", "gpu"}
    for path in specs:
        spec = load_study(path)
        points = spec.points()
        grid = {
            (fam, u, e, s)
            for s in spec.sizes
            for fam, family in spec.families.items()
            for u in spec.unique_tokens
            for e in spec.lengths(u)
            if family.max_epochs is None or e <= family.max_epochs
        }
        assert {(p.family, p.unique_tokens, p.epochs, p.size) for p in points} == grid and len(points) == len(grid)


def test_epochs_per_budget_and_a_familys_most_epochs(tmp_path):
    """A control of many unique tokens at 1 epoch beside a small budget repeated; AR arms stopped at 50 epochs
    while diffusion goes to 800 (the literature's shape)."""
    text = SPEC.replace("epochs: [1, 2.5]", "epochs: {1000: [4, 50, 800], 4000: [1]}").replace(
        "  ar-mir: [diffusion.model_running_mode=ar, diffusion.mir_mask_share=0.25, diffusion.mir_weight=0.4]",
        "  ar-mir:\n    overrides: [diffusion.model_running_mode=ar, diffusion.mir_mask_share=0.25]\n    max_epochs: 50",
    )
    spec = load_study(_spec(tmp_path, text.replace("sizes: [tiny, null]", "")))
    labels = [p.label for p in spec.points()]
    assert labels == [
        "masked-u1000-e4",
        "masked-u1000-e50",
        "masked-u1000-e800",
        "masked-u4000-e1",
        "ar-mir-u1000-e4",
        "ar-mir-u1000-e50",
        "ar-mir-u4000-e1",
    ]
    point = spec.points()[-1]
    assert point.cfg.diffusion.mir_mask_share == 0.25 and point.cfg.train.epochs == 1
    assert point.overrides[-2:] == ["data.unique_tokens=4000", "train.epochs=1"]


@pytest.mark.parametrize(
    "epochs, family, says",
    [
        ("{1000: [4]}", "", "epochs: a list per budget must name each of unique_tokens [1000, 4000] once"),
        ("{1000: [4], 4000: [1, 1]}", "", "study.yaml: epochs: 4000: must be distinct positive numbers of epochs"),
        ("[4, 8]", "    max_epochs: 2", "families.ar-mir.max_epochs=2 is below every epochs of the grid"),
        ("[4, 8]", "    max_epoch: 50", "families.ar-mir.max_epoch: unknown field"),
    ],
)
def test_bad_epochs_per_budget_or_family_are_one_line(tmp_path, epochs, family, says):
    text = SPEC.replace("epochs: [1, 2.5]", f"epochs: {epochs}").replace(
        "  ar-mir: [diffusion.model_running_mode=ar, diffusion.mir_mask_share=0.25, diffusion.mir_weight=0.4]",
        "  ar-mir:\n    overrides: [diffusion.model_running_mode=ar]" + (f"\n{family}" if family else ""),
    )
    with pytest.raises(ConfigError) as err:
        load_study(_spec(tmp_path, text))
    assert "\n" not in str(err.value) and says in str(err.value), str(err.value)


def test_points_scored_on_other_heldout_tokens_are_refused(tmp_path):
    spec = load_study(
        _spec(tmp_path, SPEC.replace("diffusion.mir_weight=0.4]", "diffusion.mir_weight=0.4, eval.max_sequences=3]"))
    )
    with pytest.raises(ConfigError, match=r"points masked-tiny-u1000-e1 and ar-mir-tiny-u1000-e1 differ in eval, so"):
        spec.points()


def test_the_gpu_studys_strong_arms_shrink_weights_as_xu_et_al_do():
    """AdamW shrinks every decayed weight by lr x weight decay a step: Xu et al.'s strong AR arm does 4e-3, 2.4e-3
    and 1.6e-3 a step at 72M, 140M and 257M, under a WSD schedule that holds the lr at its peak. The GPU study's
    strong arms are within 2x of those at every size, on the same kind of schedule (a cosine one would take the
    shrink to a tenth by the end)."""
    spec = load_study(Path(__file__).parents[3] / "configs" / "studies" / "gpu.yaml")
    xu = {"70m": 4e-3, "125m": 2.4e-3, "250m": 1.6e-3}
    strong = [p for p in spec.points() if p.family in ("ar-strong", "ar-mir")]
    assert {p.size for p in strong} == set(xu)
    for p in strong:
        o, s = p.cfg.train.optimizer, p.cfg.train.schedule
        assert 0.5 < o.lr * o.weight_decay / xu[p.size] < 2, (p.label, o.lr * o.weight_decay)
        assert s.lr_schedule == "wsd" and not o.decay_embeddings and p.cfg.model.dropout == 0.1
