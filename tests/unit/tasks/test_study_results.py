"""The study's results: the crossover per budget (the smallest epochs at which the best diffusion family beats the
best AR family, or none), the table (CSV and markdown) and the plot."""

import csv

from difflm.tracking.plots import plot_study
from tasks.study import crossover, crossover_line, write_table


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
