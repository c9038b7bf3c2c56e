"""The study's results: the crossover per budget (the smallest epochs at which the best diffusion family beats the
best AR family, or none), the table (CSV and markdown) and the plot."""

import csv
import json
from types import SimpleNamespace

from PIL import Image

from difflm.tasks.study import crossover, crossover_line, training_curve, write_curves, write_table
from difflm.tracking.plots import plot_study


def _row(family, kind, budget, epochs, nll):
    return {
        "family": family,
        "kind": kind,
        "unique_tokens": budget,
        "epochs": epochs,
        "size": "preset",
        "validation_nll": nll,
        "bound": "elbo" if kind == "diffusion" else "exact",
        "steps": 10,
        "tokens_seen": 1280,
        "status": "ran train",
        "mlflow_run_id": "",
    }


ROWS = [
    # budget 1000: AR wins at 1 epoch, the best diffusion family (masked) wins at 4, the strong AR arm too late
    _row("masked", "diffusion", 1000, 1, 5.0),
    _row("uniform", "diffusion", 1000, 1, 5.5),
    _row("ar", "ar", 1000, 1, 4.5),
    _row("ar-strong", "ar", 1000, 1, 4.6),
    _row("masked", "diffusion", 1000, 4, 4.1),
    _row("ar", "ar", 1000, 4, 4.4),
    _row("ar-strong", "ar", 1000, 4, 4.2),
    _row("masked", "diffusion", 1000, 16, 3.9),
    _row("ar", "ar", 1000, 16, 4.8),
    # budget 9000: AR wins at every epochs; a failed diffusion point is no win
    _row("masked", "diffusion", 9000, 1, 4.0),
    _row("ar", "ar", 9000, 1, 3.5),
    {**_row("masked", "diffusion", 9000, 4, ""), "status": "failed: RuntimeError: x"},
    _row("ar", "ar", 9000, 4, 3.4),
]


def test_the_crossover_is_the_smallest_epochs_where_the_best_diffusion_beats_the_best_ar():
    assert crossover(ROWS) == {1000: 4, 9000: None}
    assert crossover_line(crossover(ROWS)) == "1,000 unique tokens: 4 epochs; 9,000 unique tokens: none"
    assert crossover([r for r in ROWS if r["kind"] == "ar"]) == {1000: None, 9000: None}  # no diffusion: none


def test_the_table_and_plot_are_written(tmp_path):
    csv_path, md_path = write_table(ROWS, tmp_path / "out")
    with csv_path.open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(ROWS) and table[4]["family"] == "masked" and table[4]["validation_nll"] == "4.1"
    md = md_path.read_text()
    assert md.startswith("| family | kind | unique_tokens | epochs |") and md.count("\n|") == len(ROWS) + 1
    assert "1,000 unique tokens: 4 epochs; 9,000 unique tokens: none" in md
    plot = plot_study(ROWS, tmp_path / "study.png", "t")
    assert plot and plot.read_bytes()[:4] == b"\x89PNG"
    assert plot_study([ROWS[-2]], tmp_path / "none.png") is None  # nothing finished: no plot


def test_a_points_training_curve_is_its_validations_in_epochs_seen(tmp_path):
    """metrics.jsonl's val_loss after the first step, its step turned into the epochs seen over the subset."""
    records = [
        {"step": 0, "val_loss": 8.3},  # the untrained model: not a point of the curve
        {"step": 5, "loss": 7.0},
        {"step": 10, "val_loss": 6.5},
        {"step": 20, "val_loss": 6.9, "loss": 5.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    point = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(global_batch_size=4, seq_length=32)))
    # 4 x 32 = 128 tokens a step over a 640-token subset: 5 steps an epoch
    assert training_curve(point, str(tmp_path), 640) == [(10, 2.0, 6.5), (20, 4.0, 6.9)]


def test_the_curves_are_written_and_plotted_beside_the_table(tmp_path):
    rows = [dict(r) for r in ROWS]
    rows[7]["curve"] = [(4, 1.0, 4.9), (8, 2.0, 4.3), (16, 4.0, 4.0)]  # masked, 1000 tokens, 16 epochs
    rows[5]["curve"] = [(4, 1.0, 4.6)]  # ar, 1000 tokens, 4 epochs: its longest point with a curve
    path = write_curves(rows, tmp_path)
    with path.open() as f:
        lines = list(csv.DictReader(f))
    assert [(c["family"], c["epochs"], c["step"], c["val_loss"]) for c in lines] == [
        ("ar", "4", "4", "4.6"),
        ("masked", "16", "4", "4.9"),
        ("masked", "16", "8", "4.3"),
        ("masked", "16", "16", "4.0"),
    ]
    with_curves = plot_study(rows, tmp_path / "curves.png")
    without = plot_study(ROWS, tmp_path / "table.png")
    assert with_curves and without
    assert Image.open(with_curves).width > 1.4 * Image.open(without).width  # a third panel: the curves
