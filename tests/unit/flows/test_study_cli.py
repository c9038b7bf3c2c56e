"""`difflm study SPEC`: a bad spec or a bad point is one line and exit 2, before any server starts."""

import pytest

from flows import cli


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


def test_a_missing_spec_is_one_line(tmp_path, capsys):
    assert cli.main(["study", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.yaml: cannot be read" in err, err
