"""`difflm study SPEC --plan` on real data: each point's unique tokens are those its run trains on (whole documents,
the subset data prep writes), and the plan refuses exactly the points the run refuses (the warm-up against the
steps, the budget against the split), for a spec of the test's and for every spec shipped in configs/studies."""

from pathlib import Path

import pytest

from difflm.config import ConfigError, study_spec
from difflm.data_prep.pipeline import prepare_data
from difflm.errors import UserError
from difflm.flows import cli
from difflm.tasks.study_plan import count_tokens, plan, planned_steps, short_of_warmup

STUDIES = sorted((Path(__file__).parents[2] / "configs" / "studies").glob("*.yaml"))

SPEC = """
name: edges
preset: test-tiny
base: [workdir={workdir}, train.schedule.warmup_iters=4]
families:
  masked: [diffusion.model_running_mode=difflm-noshift]
unique_tokens: [1000, 100000000]
epochs: [0.01, 0.1, 1]
"""


def _run_verdicts(points) -> tuple[dict[str, int], dict[str, str]]:
    """What the runs do with the data: the pipeline's own data prep (the budget's subset written) and its length
    check (flows/pretrain.py `_data_ready`), point by point."""
    tokens, refused = {}, {}
    for point in points:
        try:
            tokens[point.label] = n = prepare_data(point.cfg).unique_tokens
            point.cfg.with_unique_tokens(n)
        except (ConfigError, UserError) as err:
            refused[point.label] = " ".join(str(err).split())
    return tokens, refused


@pytest.mark.integration  # data prep of the test-tiny corpus (the session's), subsets written
def test_the_plan_counts_whole_documents_and_refuses_what_the_run_refuses(session_dir, tiny_manifest, tmp_path):
    path = tmp_path / "edges.yaml"
    path.write_text(SPEC.format(workdir=session_dir / "shared"))
    points = study_spec(path).points()
    counts = count_tokens(points)
    tokens, refused = _run_verdicts(points)
    assert counts.exact and counts.tokens == tokens and counts.refused == refused
    # the budget's whole documents: a thousand tokens are one article of several thousand
    assert tokens["masked-u1000-e1"] > 2 * 1000
    # 0.1 epochs are 1 step of the nominal budget (within the warm-up of 4) but more of its documents: it runs
    assert planned_steps(points[1], 1000) == 1 and "masked-u1000-e0.1" not in refused
    assert planned_steps(points[1], tokens["masked-u1000-e0.1"]) > 4
    assert "warmup_iters (4) must be below that" in refused["masked-u1000-e0.01"]
    big = [p.label for p in points if p.unique_tokens == 100_000_000]
    assert all("is more than the training split holds" in refused[label] for label in big)
    rows = plan(points, "H200", 0.4, counts)
    assert rows[1]["unique tokens"] == tokens["masked-u1000-e0.1"] and rows[1]["steps"] > 4


@pytest.mark.integration  # data prep of the tiny-cpu corpus (about 10 s), the specs' subsets written
@pytest.mark.parametrize("spec", STUDIES, ids=[p.stem for p in STUDIES])
def test_every_shipped_spec_plans_what_its_run_does(spec, tmp_path_factory, capsys):
    """The plan of every shipped spec refuses nothing its run accepts and accepts nothing it refuses; the specs
    whose data is here (the demo corpus) are counted from it, and the demo and CPU studies run every point. A spec
    whose corpus is elsewhere (the GPU study's) is planned on its nominal budgets: none of its points is within its
    warm-up there, and a run's steps are at least those (its subset holds at least the budget, or it is refused for
    the budget, not the warm-up)."""
    workdir = tmp_path_factory.getbasetemp() / "shipped-studies"  # one data prep for the specs that share it
    points = study_spec(spec, overrides=[f"workdir={workdir}"]).points()
    counts = count_tokens(points)
    if spec.stem == "gpu":
        assert not counts.exact and "/data/corpus" in counts.why
        assert short_of_warmup(points, counts) == [] and counts.refused == {}
        return
    assert counts.exact, counts.why
    tokens, refused = _run_verdicts(points)
    assert counts.tokens == tokens and counts.refused == refused == {}
    assert cli.main(["study", str(spec), "--plan", f"workdir={workdir}"]) == 0
    out = capsys.readouterr().out
    assert f"{len(points)} points, " in out and "each budget in whole documents of the prepared data" in out
    if spec.stem == "demo":  # with tiny-cpu's own warm-up, the four 1-epoch points (16 steps) fail, as they did
        again = study_spec(spec, overrides=[f"workdir={workdir}", "train.schedule.warmup_iters=60"]).points()
        refused_before = count_tokens(again).refused
        assert refused_before == _run_verdicts(again)[1]
        assert sorted(refused_before) == sorted(p.label for p in again if p.epochs == 1)
        assert cli.main(["study", str(spec), "--plan", f"workdir={workdir}", "train.schedule.warmup_iters=60"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "study demo: 4 of 12 points would fail" in err and "is 16 steps" in err, err
