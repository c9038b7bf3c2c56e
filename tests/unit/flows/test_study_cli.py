"""`difflm study SPEC`: a bad spec or a bad point is one line and exit 2, before any server starts."""

import pytest

from difflm.flows import cli


@pytest.mark.parametrize(
    "text, says",
    [
        ("families: {a: []}\nunique_tokens: [1000]\n", "epochs: missing: The lengths in epochs"),
        (
            "preset: test-tiny\nfamilies: {a: [model.num_layerz=2]}\nunique_tokens: [1000]\nepochs: [1]\n",
            "study study, point a-u1000-e1: invalid configuration: model.num_layerz: unknown field",
        ),
    ],
)
def test_a_bad_study_is_one_line(tmp_path, capsys, text, says):
    spec = tmp_path / "s.yaml"
    spec.write_text(text)
    assert cli.main(["study", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "data").exists()  # refused before any data is prepared


def test_a_missing_spec_is_one_line(tmp_path, capsys):
    assert cli.main(["study", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.yaml: cannot be read" in err, err


SPEC = """
preset: test-tiny
base: [train.schedule.warmup_iters=1]
families:
  masked: [diffusion.model_running_mode=difflm-noshift]
  ar-mir:
    overrides: [diffusion.model_running_mode=ar, diffusion.mir_mask_share=0.25]
    max_epochs: 4
unique_tokens: [8192]
epochs: [4, 16]
"""


def test_the_plan_is_each_points_cost_and_the_total(tmp_path, capsys):
    """--plan trains nothing: per point its steps, tokens and training FLOPs, the trainer's own count, and the
    device-hours at the MFU given; the total last. Data that cannot be read here (a corpus on a cluster) leaves
    the nominal budgets, and the plan says so (tests/integration/test_study_plan.py: the counts from real data)."""
    from difflm.config import load_study
    from difflm.models.diffusion.modes import build_objective
    from difflm.models.megatron.flops import forward_flops_per_sequence
    from difflm.tasks.study_plan import plan

    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC.replace("base: [", f"base: [workdir={tmp_path}, data.sources={tmp_path}/corpus.jsonl, "))
    assert cli.main(["study", str(spec), "--plan", "--device", "H100", "--mfu", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| point | unique tokens | params | steps | tokens | training FLOPs | device-hours |"), out
    assert "| masked-u8192-e4 | 8,192 | " in out and "unique tokens: the nominal budgets (the data cannot be" in out
    assert "corpus.jsonl' does not exist" in out and not (tmp_path / "data").exists()  # nothing prepared
    points = load_study(spec).points()
    assert [p.label for p in points] == ["masked-u8192-e4", "masked-u8192-e16", "ar-mir-u8192-e4"]
    rows = plan(points, "H100", 0.5)
    cfg = points[0].cfg  # test-tiny: 4 sequences of 32 tokens a step, 8,192 x 4 epochs = 256 steps
    assert [r["steps"] for r in rows] == [256, 1024, 256] and rows[0]["tokens"] == 8192 * 4
    seq = cfg.train.seq_length
    forward = forward_flops_per_sequence(cfg, cfg.tokenizer.vocab_size, seq, objective=build_objective(cfg.diffusion))
    assert rows[0]["training FLOPs"] == 256 * cfg.train.global_batch_size * 3 * forward  # forward + backward
    assert rows[1]["training FLOPs"] == 4 * rows[0]["training FLOPs"]
    ar = points[2].cfg
    ar_forward = forward_flops_per_sequence(ar, ar.tokenizer.vocab_size, seq, objective=build_objective(ar.diffusion))
    assert rows[2]["training FLOPs"] == 256 * ar.train.global_batch_size * 3 * 2 * ar_forward  # MIR: two rows
    assert rows[0]["device-hours"] == rows[0]["training FLOPs"] / (989e12 * 0.5) / 3600
    total = sum(r["training FLOPs"] for r in rows)
    assert f"3 points, {8192 * 24:,} tokens, {total:.3g} FLOPs of training:" in out and "H100-hours at MFU 0.5" in out


@pytest.mark.parametrize(
    "flags, says", [(["--device", "TPU"], "no peak FLOP/s known for device 'TPU'"), (["--mfu", "2"], "--mfu 2 is")]
)
def test_a_plan_for_an_unknown_device_or_mfu_is_one_line(tmp_path, capsys, flags, says):
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC.replace("base: [", f"base: [workdir={tmp_path}, "))
    assert cli.main(["study", str(spec), "--plan", *flags]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "data").exists()  # refused before any data is prepared


def test_a_nominal_plan_flags_the_points_within_their_warm_up(tmp_path, capsys):
    """Without the data the plan cannot say whether whole documents lift a short point past its warm-up: it
    warns, and refuses nothing (the run may accept it)."""
    spec = tmp_path / "s.yaml"
    base = f"base: [workdir={tmp_path}, data.sources={tmp_path}/corpus.jsonl, train.schedule.warmup_iters=256]"
    spec.write_text(SPEC.replace("base: [train.schedule.warmup_iters=1]", base))
    assert cli.main(["study", str(spec), "--plan"]) == 0
    out = capsys.readouterr().out
    warned = [line.split(":")[1].strip() for line in out.splitlines() if line.startswith("warning:")]
    assert warned == ["masked-u8192-e4", "ar-mir-u8192-e4"], out  # 256 steps each, not below 256
