"""The evaluation record's counters (models/evaluation/efficiency.py) on samplers whose model calls are known: NFE counts
every forward (guidance's second call, rejected positions, the block cache's fills), TPF is valid tokens over NFE
from summed counters with the prompt, the padding and what follows EOS excluded; AUP on known points; reproduction
and comparison of records."""

from __future__ import annotations

import dataclasses
import math

import pytest

from benchmarks.gpu import decoding
from difflm.models.diffusion import MaskedSampler
from difflm.models.evaluation.efficiency import aup, decode_counts
from difflm.models.evaluation.protocol import differences
from difflm.models.evaluation.record import EvalRecord
from difflm.models.evaluation.reproduce import compare, reproduction
from difflm.models.evaluation.scoring import Scorer

pytestmark = pytest.mark.unit

SHAPE = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
         "intermediate_size": 32, "max_position_embeddings": 64}  # fmt: skip
PROMPTS = ["5 6 7 8 9 10", "11 12"]  # unequal lengths: the shorter is left-padded


def scorer(mode: str, block_size: int | None = None) -> Scorer:
    return Scorer(decoding.random_model(SHAPE, mode, block_size), decoding.IdTokenizer(), batch_size=1, seed=0)


def generated(records: list[dict]) -> list[list[int]]:
    return [[int(t) for t in r["completion"].split()] for r in records]


def test_nfe_is_every_model_call_and_tpf_is_valid_tokens_over_them():
    s = scorer("difflm-noshift")
    n = 8
    recs = s.generate(PROMPTS, n, MaskedSampler(steps=4, stop_at_eos=False))
    assert [r["nfe"] for r in recs] == [4, 4]  # 4 steps, one call each, whatever the prompt's length
    assert [r["model_calls"] for r in recs] == [4, 4]  # the sampler's own tally agrees
    # valid tokens: the generated ones up to the first EOS (id 0), never the prompt's
    assert [r["tokens"] for r in recs] == [len(g) for g in generated(recs)]
    counts = decode_counts(recs)
    assert counts["nfe"] == 8 and counts["tpf"] == counts["valid_tokens"] / 8

    # guidance: two calls per step, both counted
    guided = s.generate(PROMPTS, n, MaskedSampler(steps=4, cfg_scale=1.0, stop_at_eos=False))
    assert [r["nfe"] for r in guided] == [8, 8]

    # threshold 0: every masked position commits at the first step: one call, all n tokens (TPF = n / 1)
    eager = s.generate(PROMPTS[:1], n, MaskedSampler(threshold=0.0, stop_at_eos=False))
    assert eager[0]["nfe"] == 1
    # threshold 1: nothing is that confident, one token per step (the rejected positions are in each call)
    strict = s.generate(PROMPTS[:1], n, MaskedSampler(threshold=1.0, stop_at_eos=False))
    assert strict[0]["nfe"] == n


def test_padding_in_a_batch_changes_neither_the_tokens_nor_the_counts():
    s = scorer("difflm-noshift")
    one = [s.generate([p], 6, MaskedSampler(steps=3, stop_at_eos=False))[0] for p in PROMPTS]
    s.batch_size = 2
    both = s.generate(PROMPTS, 6, MaskedSampler(steps=3, stop_at_eos=False))
    assert [r["completion"] for r in both] == [r["completion"] for r in one]
    assert [r["tokens"] for r in both] == [r["tokens"] for r in one]
    assert [r["nfe"] for r in both] == [3, 3]  # each row rode its batch's 3 calls


def test_eos_truncates_the_valid_tokens():
    s = scorer("difflm-noshift")
    rec = s.generate(PROMPTS[:1], 8, MaskedSampler(steps=8, stop_at_eos=False))[0]
    s.model.config.eos_token_id = s.eos = int(generated([rec])[0][2]) if rec["tokens"] > 2 else 0
    again = s.generate(PROMPTS[:1], 8, MaskedSampler(steps=8, stop_at_eos=False))[0]
    assert again["tokens"] <= 2 and decode_counts([again])["tpf"] == again["tokens"] / again["nfe"]


def test_block_diffusion_counts_its_cache_fills_and_ar_one_call_per_token():
    s = scorer("difflm-block", block_size=4)
    cached = s.generate(PROMPTS[:1], 8, MaskedSampler(steps=8, stop_at_eos=False))[0]
    uncached = s.generate(PROMPTS[:1], 8, MaskedSampler(steps=8, stop_at_eos=False, kv_cache=False))[0]
    assert cached["completion"] == uncached["completion"]  # the exact cache
    # the hook and the sampler's tally agree; the cache's fills of finished blocks are calls too
    assert (cached["nfe"], uncached["nfe"]) == (cached["model_calls"], uncached["model_calls"])
    assert cached["nfe"] > uncached["nfe"]
    ar = scorer("ar").generate(PROMPTS[:1], 5, MaskedSampler(stop_at_eos=False))[0]
    assert ar["nfe"] == 5


def test_aup_of_known_points():
    assert aup([(1.0, 80.0)]) == 80.0  # one setting: its accuracy at TPF 1
    # no accuracy lost: the area is TPF x accuracy
    assert aup([(1.0, 80.0), (3.0, 80.0)]) == pytest.approx(240.0)
    # a point that lost accuracy counts less (W = exp(-3 (1 - 76/80)))
    w = math.exp(-3 * (1 - 76 / 80))
    assert aup([(1.0, 80.0), (3.0, 76.0)]) == pytest.approx(80 + 2 * (80 + 76 * w) / 2)
    assert aup([(1.0, 80.0), (4.0, 50.0)]) == 80.0  # more than 5 points below: left out
    assert aup([]) is None


def _record(**changes) -> EvalRecord:
    base = EvalRecord(
        mode="difflm-noshift",
        data_hash="d",
        export="/x/hf",
        device="cpu",
        dtype="float32",
        device_name="cpu",
        bounds={"trained": {"nll_per_token": 3.0, "stderr": 0.05}},
        tasks={"cloze_gen": {"exact_match_flexible": 0.5, "exact_match_flexible_stderr": 0.1}},
        model={"weights_sha256": "w", "mode": "difflm-noshift"},
        decoding={"steps": 8, "threshold": None, "temperature": 0.0, "gen_length": 8, "seed": 0},
        task_settings={"items": 32},
        efficiency={"nfe": 64, "valid_tokens": 64, "tpf": 1.0, "tokens_per_s_batch1": 100.0},
        environment={"host": "a"},
    )
    return dataclasses.replace(base, **changes)


def test_reproduction_within_standard_errors_and_what_differs():
    a = _record()
    ok, lines = reproduction(a, _record(bounds={"trained": {"nll_per_token": 3.04, "stderr": 0.05}}))
    assert ok and any(line.startswith("reproduced: bound nats/token") for line in lines)
    b = _record(decoding={**a.decoding, "steps": 4}, efficiency={**a.efficiency, "nfe": 32, "tpf": 2.0})
    ok, lines = reproduction(a, b)
    assert not ok and "NOT reproduced: nfe 64 -> 32" in "\n".join(lines)
    assert differences(a, b) == ["decoding.steps: 8 -> 4"] and "decoding.steps: 8 -> 4" in lines[-2]


def test_compare_across_machines_drops_tokens_per_second(tmp_path):
    a, b = _record(), _record(environment={"host": "b"}, mode="ar")
    files = compare([("a", a), ("b", b)], tmp_path / "same")
    assert "tokens/s (batch 1)" not in files["table"].read_text() and "different machines" in files["table"].read_text()
    assert "(AR)" in files["table"].read_text() and files["picture"].stat().st_size > 5_000
    files = compare([("a", a), ("a2", _record())], tmp_path / "one")
    assert "tokens/s (batch 1)" in files["table"].read_text()


def test_record_round_trips_its_new_fields(tmp_path):
    rec = _record(aup={"value": 1.0}, baseline={"mode": "ar", "tpf": 1.0})
    assert EvalRecord.read(rec.write(tmp_path)).to_dict() == rec.to_dict()
    assert rec.nfe == 64 and rec.tpf == 1.0
