"""The order a study's points start in: the grid's one at a time; with several at once the longest first (by
training FLOPs), so the study does not end on a long point training alone; the table keeps the grid's order."""

import csv

import pytest

from difflm.config import load_study
from difflm.flows import study as study_flow
from difflm.tasks import study as results
from difflm.tasks.study_plan import point_flops

SPEC = """
preset: test-tiny
base: [tracking.enabled=false, train.schedule.warmup_iters=1]
families:
  masked: []
  ar-mir: [diffusion.model_running_mode=ar, diffusion.mir_mask_share=0.25]
unique_tokens: [1000]
epochs: [1, 8, 2]
parallel: {parallel}
output: {out}
"""


@pytest.mark.parametrize("parallel", [1, 2])
def test_points_start_longest_first_and_the_table_keeps_the_grid_order(tmp_path, monkeypatch, parallel):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(SPEC.format(parallel=parallel, out=tmp_path / "out"))
    spec = load_study(spec_file)
    grid = [p.label for p in spec.points()]
    assert grid[:3] == ["masked-u1000-e1", "masked-u1000-e8", "masked-u1000-e2"]
    started: list[str] = []

    def point(spec, p, i, n, parent, say):
        started.append(p.label)
        return results.failed_row(p, RuntimeError("not trained here"))

    monkeypatch.setattr(study_flow, "_run_point", point)
    with pytest.raises(study_flow.StudyFailed):
        study_flow.run_study(spec, lambda line: None)
    if parallel == 1:
        assert started == grid
    else:  # MIR trains two rows a sequence: its 8 epochs cost twice the masked 8 epochs
        assert started[:2] == ["ar-mir-u1000-e8", "masked-u1000-e8"], started
        cost = {p.label: point_flops(p) for p in spec.points()}
        assert [cost[label] for label in started] == sorted(cost.values(), reverse=True)
    with (tmp_path / "out" / "results.csv").open() as f:
        table = [(r["family"], float(r["epochs"])) for r in csv.DictReader(f)]
    assert table == [(p.family, p.epochs) for p in spec.points()]  # the grid's order, whatever the start order
