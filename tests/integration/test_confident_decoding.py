"""A masked-diffusion model trained to be confident (benchmarks/confident_decoding.py: the pipeline's data prep,
torchrun training and export on a copy task: repeated words) decodes several tokens per forward with a confidence
threshold, the same tokens as one token per step; an AR model of the same size, trained on the same data, is timed
with its KV cache in the same run."""

from __future__ import annotations

import pytest

from benchmarks.confident_decoding import BASELINE, run, table, train


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("confident")
    return {mode: train(workdir, mode) for mode in ("difflm-noshift", "ar")}


@pytest.mark.usefixtures("one_thread")  # decoding a model this small: steadier on a shared machine
@pytest.mark.slow(
    reason="two models trained under torchrun (data prep, 150 steps, export each), then every decoder timed"
)
def test_threshold_decoding_of_a_confident_model_is_parallel_at_equal_output_beside_ar(exports):
    result = run(exports, items=8, n=24)
    print("\n" + table(result))  # the measured rows, AR's tokens/s beside the masked model's
    rows = {r["decoder"]: r for r in result["rows"]}
    base = rows[BASELINE]
    assert base["tpf"] == pytest.approx(1.0, abs=0.05) and base["score"] >= 0.75  # the model learnt the task
    parallel = [r for name, r in rows.items() if r["mode"] == "difflm-noshift" and "threshold" in name]
    assert len(parallel) == 2  # threshold 0.9 over the whole generation, and in blocks of 8
    for row in parallel:
        assert row["tpf"] >= 2.0, table(result)  # several tokens per model call ...
        assert row["same"] == 1.0 and row["score"] == base["score"], table(result)  # ... the baseline's very tokens
    ar = rows["AR + KV cache (greedy)"]
    assert ar["tokens_per_s_batch1"] > 0 and ar["tokens_per_s_batched"] > 0
    assert ar["tpf"] == pytest.approx(1.0, abs=0.05)  # one token per call: the cache's prefill is the first call
