"""The objective as one object per mode (models/diffusion/modes.py), and the defects a correctness review
found in the code it replaced: each test here failed on
the code before the objectives moved into one object."""

from __future__ import annotations

import ast
import math
import types
import warnings
from pathlib import Path

import pytest
import torch
from helpers import HF_VOCAB as V
from helpers import TinyBidirectional, tiny_config
from helpers import timed_hf_model as _model

from difflm.config import PipelineConfig
from difflm.models.diffusion import MaskedSampler, sample_masked_diffusion
from difflm.models.diffusion.conditional import conditional_masked_nll
from difflm.models.diffusion.documents import document_ids
from difflm.models.diffusion.modes import MODES, Objective, build_objective, objective_class
from difflm.models.evaluation.scoring import Scorer
from difflm.models.evaluation.tasks import score_cloze
from difflm.models.megatron.forward_step import SpecialTokens, corrupt

ROOT = Path(__file__).resolve().parents[4]
SPECIAL = SpecialTokens(mask_id=1, vocab_size=50, special_ids=(0, 1, 2), eos_id=0, pad_id=2)


def _batch(x0: torch.Tensor, loss_mask: torch.Tensor | None = None) -> dict:
    batch = {"tokens": x0, "labels": x0, "positions": torch.arange(len(x0))}
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    return batch


# ---- one object per mode ----------------------------------------------------------------------------------


def test_every_configurable_mode_is_one_objective_class_with_its_facts():
    schema = PipelineConfig.model_json_schema()["$defs"]["DiffusionConfig"]  # one member per mode
    modes = schema["discriminator"]["mapping"]
    assert set(modes) == set(MODES)
    facts = {
        m: (
            c.bidirectional,
            c.uses_t,
            c.requires_t,
            c.shifted,
            c.full_logits,
            c.exact,
            c.has_greedy,
            c.attention_flops_factor(),
        )
        for m, c in MODES.items()
    }
    assert facts == {
        "difflm-noshift": (True, True, False, False, False, False, True, 1.0),
        "difflm-shift": (True, True, False, True, False, False, True, 1.0),
        "difflm-noshift-uniform": (True, True, True, False, True, False, False, 1.0),
        "ar": (False, False, False, False, False, True, True, 0.5),
        "difflm-block": (True, False, False, False, False, False, True, 1.0),
    }
    assert all(issubclass(c, Objective) and c.name == m for m, c in MODES.items())
    with pytest.raises(ValueError, match="unknown model_running_mode 'difflm-typo'"):
        objective_class("difflm-typo")


MODE_NAMES = set(MODES)


def _compares_a_mode(node: ast.AST) -> bool:
    """`x == "ar"`, `mode != "difflm-shift"`, `mode in ("difflm-noshift", ...)`: a comparison with a mode string."""
    if not isinstance(node, ast.Compare):
        return False
    for side in (node.left, *node.comparators):
        values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
        if any(isinstance(v, ast.Constant) and v.value in MODE_NAMES for v in values):
            return True
    return False


def test_no_code_outside_the_objectives_compares_the_mode_string():
    """Adding a mode is one class in models/diffusion/modes.py: nothing else branches on the mode's name (the config
    declares the names; tests may)."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if (
            rel.parts[0] in ("tests", ".venv")
            or rel.parts[:2] == ("models", "diffusion")
            or rel.parts[:2] == ("difflm", "config")
        ):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _compares_a_mode(node):
                bad.append(f"{rel}:{node.lineno}")
    assert not bad, "mode string compared outside models/diffusion/modes.py: " + ", ".join(bad)


def test_the_mode_comparison_finder_finds_one():
    tree = ast.parse('if cfg.diffusion.model_running_mode == "ar": pass\nif m in ("difflm-shift", "x"): pass')
    assert sum(_compares_a_mode(n) for n in ast.walk(tree)) == 2


# ---- difflm-shift scores real next tokens only, and its bound conditions on token 0 ---------------


def test_shift_training_never_scores_the_first_padding_token():
    """Position 20 was scored on target x0[21], the first padding token, in 34 of 64 rows."""
    cfg = tiny_config(
        "/tmp/unused",
        "diffusion.model_running_mode=difflm-shift",
        "train.global_batch_size=64",
        "train.micro_batch_size=64",
    )
    x0 = torch.randint(3, 50, (64, 32), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones(64, 32, dtype=torch.bool)
    loss_mask[:, 20:] = False  # labels 20.. (tokens 21..) are padding
    x0[:, 21:] = 0  # what GPTDataset puts there
    obj = build_objective(cfg.diffusion, SPECIAL.ids())
    prep = corrupt(_batch(x0, loss_mask), cfg, SPECIAL, step=5, objective=obj)
    assert prep["scored"][:, :20].any() and not prep["scored"][:, 20:].any()
    ce = torch.full((64, 32), 2.0)
    ce[:, 20:] = 1000.0  # the CE of predicting padding: it must not leak into the loss
    total, count = obj.loss_terms(ce, prep, False)
    assert int(count) == 64 * 20 and float(total / count) < 10


def test_shift_validation_conditions_on_token_zero():
    """Copy data (every token equals token 0) and a perfect model: validation read log K / L = 0.48, because
    token 0, which no logit predicts, was masked in 58% of the rows. Kept clean, the bound is 0, as the export's."""
    k, length, b = 47, 8, 512
    cfg = tiny_config(
        "/tmp/unused",
        "diffusion.model_running_mode=difflm-shift",
        f"train.global_batch_size={b}",
        f"train.micro_batch_size={b}",
        f"train.seq_length={length}",
    )
    x0 = torch.randint(3, 3 + k, (b, 1), generator=torch.Generator().manual_seed(0)).expand(b, length).clone()
    obj = build_objective(cfg.diffusion, SPECIAL.ids())
    for step in (-1, -2, -3):
        prep = corrupt(_batch(x0), cfg, SPECIAL, step=step, evaluation=True, objective=obj)
        assert not (prep["inputs"][:, 0] == SPECIAL.mask_id).any()
        seen = (prep["inputs"] != SPECIAL.mask_id).any(-1, keepdim=True)
        ce = torch.where(seen, 0.0, math.log(k)).expand(b, length)
        total, count = obj.loss_terms(ce, prep, True)
        assert int(count) == b * (length - 1) and float(total) == 0.0


# ---- the uniform validation loss is an upper bound -------------------------------------------------------


@pytest.mark.slow  # ~23 s of CPU
def test_uniform_validation_includes_the_last_step_and_bounds_the_nll():
    """Validation integrated the NELBO over [eps, 1] only, below the NLL it claims to bound. A model predicting
    uniform over the N states has NLL exactly log N; at eps = 0.2 the missing reconstruction term is 0.54 nats."""
    vocab, b, length, eps = 8, 4096, 8, 0.2
    cfg = tiny_config(
        "/tmp/unused",
        "diffusion.model_running_mode=difflm-noshift-uniform",
        "diffusion.time_embedding=true",
        f"diffusion.eps={eps}",
        f"train.global_batch_size={b}",
        f"train.micro_batch_size={b}",
        f"train.seq_length={length}",
    )
    special = SpecialTokens(mask_id=1, vocab_size=vocab, special_ids=(0, 1, 2), eos_id=0, pad_id=2)
    states = objective_class("difflm-noshift-uniform")(mask_id=1, vocab_size=vocab, pad_id=2).states()
    n = len(states)
    x0 = states[torch.randint(n, (b, length), generator=torch.Generator().manual_seed(0))]
    values, obj = [], build_objective(cfg.diffusion, special.ids())
    for step in (-1, -2, -3, -4):
        prep = corrupt(_batch(x0), cfg, special, step=step, evaluation=True, objective=obj)
        assert int(prep["last_step"].sum()) == 1  # one sequence per global batch scores the last step
        total, count = obj.loss_terms(torch.zeros(b, length, vocab), prep, True)
        values.append(float(total / count))
    mean = sum(values) / len(values)
    assert abs(mean - math.log(n)) < 0.1, (values, math.log(n))  # the integral alone is ~0.54 below


def test_uniform_training_loss_has_no_last_step_term():
    cfg = tiny_config(
        "/tmp/unused",
        "diffusion.model_running_mode=difflm-noshift-uniform",
        "diffusion.time_embedding=true",
        "train.global_batch_size=16",
        "train.micro_batch_size=16",
    )
    special = SpecialTokens(mask_id=1, vocab_size=50, special_ids=(0, 1, 2), eos_id=0, pad_id=2)
    obj = build_objective(cfg.diffusion, special.ids())
    prep = corrupt(_batch(torch.randint(3, 50, (16, 32))), cfg, special, step=3, objective=obj)
    assert not prep["last_step"].any() and (prep["t"] >= cfg.diffusion.eps).all()


# ---- uniform models have no greedy order: n/a, not 0 ------------------------------------------------------


def _oracle(seq):
    def forward(tokens, **_):  # position i -> token seq[i] with certainty, whatever the input
        out = torch.full((*tokens.shape, V), -30.0)
        out[..., torch.arange(tokens.shape[1]), torch.tensor(seq[: tokens.shape[1]])] = 30.0
        return types.SimpleNamespace(logits=out)

    return forward


def test_uniform_is_greedy_is_not_measured_rather_than_false():
    """The scorer hard-coded is_greedy False for uniform models, so cloze accuracy 0.000 was published as if
    measured. Now: None (n/a) for uniform, True for a masked oracle; score_cloze reports acc None."""
    ctx, cont = [0, 5, 9, 11], [40, 7, 8]
    got = {}
    for mode, kw in (("difflm-noshift", {}), ("difflm-noshift-uniform", {"time_embedding": True})):
        model = _model(mode, **kw)
        model.forward = _oracle(ctx + cont)
        ((ll, greedy),) = Scorer(model, tokenizer=None, mc_samples=4).loglikelihood_tokens([(ctx, cont)])
        got[mode] = greedy
    assert got == {"difflm-noshift": True, "difflm-noshift-uniform": None}
    fake = types.SimpleNamespace(loglikelihood=lambda pairs: [(-1.0, None)] * len(pairs))
    assert score_cloze(fake, [{"context": "a", "target": "b"}])["acc"] is None


# ---- conditional likelihood and greedy check use training's documents ---------------------------------


def test_conditional_scores_use_the_document_segmentation_of_training():
    """conditional_nll and greedy_match ignored document attention: the continuation attended to the EOS the
    scorer puts at position 0, which training never let it see."""
    model = _model(document_attention=True)
    ids = torch.tensor([[0, 5, 9, 11, 40, 7, 8]])
    target = torch.zeros_like(ids, dtype=torch.bool)
    target[:, 1:] = True
    docs = document_ids(ids, 0)

    def estimate(with_docs: bool) -> float:
        fn = lambda x, m, d: model._logits(x, m, None, docs.expand(len(x), -1) if with_docs else None)  # noqa: E731
        return conditional_masked_nll(fn, ids, target, 1, 64, [torch.Generator().manual_seed(0)]).item()

    got = model.conditional_nll(ids, target, mc_samples=64, generators=[torch.Generator().manual_seed(0)]).item()
    assert got == pytest.approx(estimate(True), abs=1e-9) and abs(got - estimate(False)) > 1e-4
    seen = []
    original = model.forward

    def spy(tokens, attention_mask=None, t=None, document_ids=None, **kw):
        seen.append(document_ids)
        return original(tokens, attention_mask=attention_mask, t=t, document_ids=document_ids, **kw)

    model.forward = spy
    model.greedy_match(ids, target)
    assert seen and all(d is not None and torch.equal(d[:1], docs) for d in seen)


# ---- generation fits the model's length -------------------------------------------------------------


class _CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 40 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_generate_caps_new_tokens_to_the_model_length():
    """With max_new_tokens >= max_length (lm-eval's default 256 against 128), the prompt slice kept 228
    tokens and produced 428 positions. Now the request is capped, with a warning, and the prompt keeps >= 1 token."""
    model = _model()
    scorer = Scorer(model, _CharTokenizer(), max_length=16)
    lengths = []
    original = model.diffusion_generate

    def spy(prompt_ids, length, *a, **kw):
        lengths.append((prompt_ids.shape[1], length))
        return original(prompt_ids, length, *a, **kw)

    model.diffusion_generate = spy
    with pytest.warns(UserWarning, match="max_new_tokens=40 does not fit"):
        scorer.generate(["a long prompt of many characters"], 40, MaskedSampler(steps=4, stop_at_eos=False))
    assert lengths == [(1, 15)]


# ---- the nits ----------------------------------------------------------------------------------------------


def test_a_row_with_nothing_to_score_gets_no_bound():
    """A row with no scored token reported the cross-entropy of a position it never scored (1.98)."""
    model = _model()
    x = torch.randint(3, V, (2, 12))
    mask = torch.ones_like(x)
    mask[1, 1:] = 0  # the second row: token 0 only, which prefix_len=1 conditions on
    nll = model.elbo_nll(x, attention_mask=mask, prefix_len=1, t_samples=2, generator=torch.Generator().manual_seed(0))
    assert math.isfinite(nll[0]) and math.isnan(nll[1])


def test_model_calls_are_counted_as_made():
    """Guidance without a prompt makes one call per step, not two; the uniform sampler reports its calls."""
    model, calls = TinyBidirectional(), []
    fn = lambda x: calls.append(1) or model(x)  # noqa: E731
    stats: dict = {}
    sample_masked_diffusion(
        fn,
        torch.zeros(1, 0, dtype=torch.long),
        6,
        TinyBidirectional.MASK,
        6,
        settings=MaskedSampler(steps=6, cfg_scale=2.0, stop_at_eos=False),
        stats=stats,
    )
    assert stats["nfe"] == len(calls) == 6
    uniform = _model("difflm-noshift-uniform", time_embedding=True)
    stats = {}
    uniform.diffusion_generate(torch.tensor([[5, 6]]), 4, 3, generator=torch.Generator().manual_seed(0), stats=stats)
    assert stats["nfe"] == 3


def test_the_uniform_bound_starts_at_the_trained_eps():
    """The uniform conditional likelihood used eps = 1e-3 whatever the training; the export records its eps."""
    model = _model("difflm-noshift-uniform", time_embedding=True, eps=0.25)
    seen = []
    original = model.forward

    def spy(tokens, attention_mask=None, t=None, **kw):
        seen.append(float(t.min()))
        return original(tokens, attention_mask=attention_mask, t=t, **kw)

    model.forward = spy
    ids = torch.randint(3, V, (1, 8))
    target = torch.zeros_like(ids, dtype=torch.bool)
    target[:, 4:] = True
    model.conditional_nll(ids, target, mc_samples=4, generators=[torch.Generator().manual_seed(0)])
    assert min(seen) == pytest.approx(0.25)


def test_sampled_generations_do_not_depend_on_the_batch():
    """Sampled generations were seeded once per batch: a prompt's completion changed with its neighbours."""
    model = _model()
    settings = MaskedSampler(steps=4, temperature=1.0, stop_at_eos=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alone = Scorer(model, _CharTokenizer(), batch_size=1).generate(["abc"], 6, settings)
        batched = Scorer(model, _CharTokenizer(), batch_size=3).generate(["xyzw", "abc", "q"], 6, settings)
    assert alone[0]["completion"] == batched[1]["completion"]
    assert len({r["completion"] for r in batched}) > 1
