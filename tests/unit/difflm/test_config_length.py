"""The run's length as epochs over the unique training tokens: the conversion to steps, the one-length rule, the
budget settings and what they name."""

import pytest
import yaml

from difflm.config import ConfigError, load_config, save_config
from difflm.config.train import epochs_seen, iters_for_epochs
from difflm.rundir import run_name
from difflm.tracking import length_params


def test_epochs_become_steps_rounded_up():
    assert iters_for_epochs(3.0, 50_000, 16, 128) == 74  # ceil(150000 / 2048) = ceil(73.24)
    assert iters_for_epochs(2.0, 2048, 16, 128) == 2  # exact: no extra step
    assert iters_for_epochs(0.001, 100, 16, 128) == 1  # at least one
    assert epochs_seen(74, 50_000, 16, 128) == pytest.approx(74 * 2048 / 50_000)


def test_an_epochs_override_replaces_the_presets_steps_and_is_resolved_with_the_data():
    cfg = load_config("tiny-cpu", ["train.epochs=3", "data.unique_tokens=50000"])  # tiny-cpu sets train_iters
    assert cfg.train.epochs == 3.0 and "train.train_iters" not in cfg.flat()  # unknown until the data is
    resolved = cfg.with_unique_tokens(50_013)
    assert resolved.train.train_iters == iters_for_epochs(3.0, 50_013, 16, 128) and resolved.train.epochs is None
    assert resolved.with_unique_tokens(10) == resolved  # a length in steps stays as it is
    steps = load_config("tiny-cpu", ["data.unique_tokens=50000", f"train.train_iters={resolved.train.train_iters}"])
    assert run_name(resolved, "d") == run_name(steps, "d")  # the same run as the same steps given directly
    assert load_config("tiny-cpu").with_unique_tokens(50_000).train.train_iters == 1200


def test_a_config_in_epochs_loads_back_before_and_after_its_steps_are_known(tmp_path):
    cfg = load_config("tiny-cpu", ["train.epochs=3"])
    assert load_config(str(save_config(cfg, tmp_path / "given.yaml"))) == cfg  # the Prefect parameter's round trip
    resolved = cfg.with_unique_tokens(50_000)
    assert load_config(str(save_config(resolved, tmp_path / "config.yaml"))) == resolved


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.epochs=3", "train.train_iters=100"],
        ["train.train_iters=100", "train.epochs=3"],
    ],
)
def test_both_lengths_given_is_one_clear_error(overrides):
    with pytest.raises(ConfigError, match=r"train.train_iters \(100\) and train.epochs \(3.0\) are both set"):
        load_config("tiny-cpu", overrides)


def test_both_lengths_in_a_preset_is_an_error_and_an_override_of_either_replaces_it(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text(yaml.safe_dump({"train": {"train_iters": 50, "epochs": 2.0, "schedule": {"warmup_iters": 2}}}))
    with pytest.raises(ConfigError, match="are both set"):
        load_config(str(preset))
    assert load_config(str(preset), ["train.train_iters=40"]).train.epochs is None
    assert load_config(str(preset), ["train.epochs=4"]).train.epochs == 4.0


def test_a_warmup_longer_than_the_epochs_is_one_line_naming_both():
    cfg = load_config("tiny-cpu", ["train.epochs=1"])  # warmup 60
    with pytest.raises(
        ConfigError,
        match=r"train.epochs=1 over 2,048 unique tokens is 1 steps of 16 x 128 tokens: train.schedule.warmup_iters \(60\)",
    ):
        cfg.with_unique_tokens(2048)


def test_the_budget_names_its_own_data_folder_and_the_seed_only_with_a_budget():
    base = load_config("tiny-cpu")
    data = lambda *o: load_config("tiny-cpu", list(o)).stage_hash("data", "tokenizer")  # noqa: E731
    assert data("data.subset_seed=5") == base.stage_hash("data", "tokenizer")  # no budget: nothing to salt
    assert len({data(), data("data.unique_tokens=50000"), data("data.unique_tokens=9000")}) == 3
    assert data("data.unique_tokens=50000", "data.subset_seed=1") != data("data.unique_tokens=50000")
    budget = load_config("tiny-cpu", ["data.unique_tokens=50000", "data.subset_seed=3"])
    assert budget.without_budget().stage_hash("data", "tokenizer") == base.stage_hash("data", "tokenizer")
    assert budget.without_budget().data == base.data  # the shared prep records no budget's settings


def test_a_budget_must_hold_a_sample():
    with pytest.raises(ConfigError, match=r"data.unique_tokens \(100\) must exceed train.seq_length \(128\)"):
        load_config("tiny-cpu", ["data.unique_tokens=100"])


def test_every_run_records_its_unique_tokens_and_planned_epochs():
    steps = load_config("tiny-cpu")  # 1200 steps of 16 x 128 tokens
    assert length_params(steps, 614_400) == {
        "train.train_iters": 1200,
        "train.unique_tokens": 614_400,
        "train.planned_epochs": 4.0,
    }
    epochs = load_config("tiny-cpu", ["train.epochs=3"]).with_unique_tokens(50_000)
    assert length_params(epochs, 50_000)["train.planned_epochs"] == round(74 * 2048 / 50_000, 4)


def test_a_run_is_never_named_before_its_epochs_are_steps():
    with pytest.raises(ConfigError, match=r"train.epochs=3 is not yet a number of steps"):
        run_name(load_config("tiny-cpu", ["train.epochs=3"]), "d")
