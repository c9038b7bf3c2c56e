"""The exported model's diffusion helpers and the defects once found in them, on plain HF models.

No megatron here: `DiffLMForMaskedLM` is built from a config with random weights, or replaced by an oracle.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from helpers import HF_VOCAB, timed_hf_model

from difflm.models.diffusion import elbo_nll_per_token

V = HF_VOCAB  # ids 0 eos, 1 mask, 2 pad
_model = timed_hf_model


def test_shift_mode_bound_of_a_perfect_model_is_zero():
    """Position 0 has no logit of its own in difflm-shift; masking and scoring it gave 1.81 nats/token."""
    x0 = torch.randint(3, 50, (16, 32), generator=torch.Generator().manual_seed(0))

    def raw_oracle(tokens, **_):  # raw output at i is x0[i + 1] with certainty
        out = torch.full((*tokens.shape, V), -30.0)
        out.scatter_(-1, torch.roll(x0[: len(tokens)], -1, dims=1)[..., None], 30.0)
        return types.SimpleNamespace(logits=out)

    model = _model("difflm-shift")
    model.forward = raw_oracle
    nll = model.elbo_nll(x0, t_samples=16, generator=torch.Generator().manual_seed(1))
    assert nll.max().item() < 1e-6


def test_uniform_model_is_scored_and_sampled_at_its_true_noise_level():
    """A time-conditioned uniform model was run at t = 0 (no mask tokens to count); now t is required and
    the helpers pass it."""
    model = _model("difflm-noshift-uniform", time_embedding=True)
    x = torch.randint(3, V, (2, 12))
    with pytest.raises(ValueError, match="pass t"):
        model(x)
    seen = []
    original = model.forward

    def spy(tokens, attention_mask=None, t=None, document_ids=None, **kw):
        seen.append(t)
        return original(tokens, attention_mask=attention_mask, t=t, document_ids=document_ids)

    model.forward = spy
    model.elbo_nll(x, t_samples=4, generator=torch.Generator().manual_seed(0))
    ts = torch.cat(seen)
    assert ts.min() < 0.05 and ts.max() > 0.5  # stratified noise levels, and the eps reconstruction step
    seen.clear()
    model.diffusion_generate(x[:, :3], length=6, steps=3, generator=torch.Generator().manual_seed(0))
    assert [round(float(t[0]), 4) for t in seen] == [1.0, 0.6667, 0.3333]


def test_uniform_bound_is_log_n_for_a_context_free_uniform_model():
    """A model that always predicts uniform over the N states has likelihood exactly 1/N per token, and its
    ELBO (integral + eps reconstruction) is exactly log N too (4.12713438 by quadrature at N = 62). The
    Monte-Carlo estimate is unbiased; importance sampling of t keeps it tight."""
    model = _model("difflm-noshift-uniform")
    states = model.uniform_states()
    assert len(states) == V - 2 and 0 in states.tolist()  # EOS is a state (a training target); mask/pad are not
    model.forward = lambda tokens, **_: types.SimpleNamespace(logits=torch.zeros(*tokens.shape, V))
    x0 = states[torch.randint(len(states), (64, 64), generator=torch.Generator().manual_seed(0))]
    nll = model.elbo_nll(x0, t_samples=32, generator=torch.Generator().manual_seed(0))
    assert abs(nll.mean().item() - math.log(len(states))) < 0.05


def test_document_attention_is_used_wherever_training_used_it():
    """A model trained with document attention is scored and sampled with it by default."""
    model = _model(document_attention=True)
    x = torch.randint(3, V, (1, 20))
    x[0, 7] = 0  # EOS: documents 0..7 and 8..19
    seeded = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    default = model.elbo_nll(x, generator=seeded())
    explicit = model.elbo_nll(x, generator=seeded(), document_ids=torch.tensor([[0] * 8 + [1] * 12]))
    ignored = model.elbo_nll(x, generator=seeded(), document_ids=torch.zeros_like(x))
    assert torch.equal(default, explicit) and not torch.equal(default, ignored)
    # generation: the prompt's earlier document is invisible to the continuation
    prompt = x[:, :12]
    other = prompt.clone()
    other[0, 3] = (other[0, 3] + 1) % 50 + 3  # change document 0 only
    a = model.diffusion_generate(prompt, length=6, steps=3)
    b = model.diffusion_generate(other, length=6, steps=3)
    assert torch.equal(a[:, 12:], b[:, 12:])


def test_ar_and_diffusion_reports_score_the_same_tokens():
    """With prefix_len=1 the diffusion bound conditions on token 0, as the AR NLL must: a token 0 the
    model finds very unlikely (CE ~ 30) moves neither number."""
    table = torch.randn(V, generator=torch.Generator().manual_seed(0))
    table[3] = -30.0
    oracle = lambda tokens, **_: types.SimpleNamespace(logits=table.expand(*tokens.shape, V))  # noqa: E731
    x0 = torch.randint(4, V, (3, 10), generator=torch.Generator().manual_seed(1))
    x0[:, 0] = 3
    ce = (
        torch.nn.functional.cross_entropy(table.expand(3, 9, V).reshape(-1, V), x0[:, 1:].reshape(-1), reduction="none")
        .view(3, 9)
        .mean(-1)
    )
    ar = _model("ar")
    ar.forward = oracle
    assert torch.allclose(ar.ar_nll(x0), ce, atol=1e-5)
    model = _model()
    model.forward = oracle
    same = model.elbo_nll(x0, t_samples=64, generator=torch.Generator().manual_seed(0), prefix_len=1)
    assert (same - ce).abs().max() < 0.15  # context-free: the bound's expectation is ce (an MC estimate)
    every = model.elbo_nll(x0, t_samples=64, generator=torch.Generator().manual_seed(0))
    assert (every - ce).min() > 2.0  # scoring token 0 too: +~30/10 nats per token


def test_helpers_refuse_the_wrong_mode_and_say_what_fits():
    """The helpers refuse a mode they do not apply to, and say which helper fits."""
    with pytest.raises(ValueError, match="ar_nll"):
        _model("ar").elbo_nll(torch.randint(3, V, (1, 8)))
    with pytest.raises(ValueError, match="token by token"):
        _model("ar").diffusion_generate(torch.randint(3, V, (1, 4)), length=4, steps=2)
    with pytest.raises(ValueError, match="elbo_nll"):
        _model().ar_nll(torch.randint(3, V, (1, 8)))
    with pytest.raises(ValueError, match="at least one prompt token"):
        _model("difflm-shift").diffusion_generate(torch.zeros(1, 0, dtype=torch.long), length=4, steps=2)


def test_batched_left_padded_generation_equals_one_prompt_at_a_time():
    """Prompts of different lengths, left-padded with their attention mask, generate what each alone does."""
    model = _model()
    prompts = [torch.randint(3, V, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 6)]
    alone = [model.diffusion_generate(p, length=5, steps=5)[:, p.shape[1] :] for p in prompts]
    ids = torch.full((2, 6), 2)
    mask = torch.zeros(2, 6, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 6 - p.shape[1] :], mask[i, 6 - p.shape[1] :] = p[0], 1
    batched = model.diffusion_generate(ids, length=5, steps=5, attention_mask=mask)[:, 6:]
    assert torch.equal(batched, torch.cat(alone))
    with pytest.raises(ValueError, match="LEFT-padded"):
        model.diffusion_generate(ids.flip(1), length=5, steps=5, attention_mask=mask.flip(1))


def test_padding_does_not_change_the_default_noise_level():
    """The default t of a masked model counts mask tokens among real tokens only."""
    model = _model(time_embedding=True)
    x = torch.tensor([[5, 1, 6, 1, 2, 2, 2, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0]])
    assert torch.allclose(model._default_t(x, mask), torch.tensor([0.5]))
    assert torch.allclose(model._default_t(x, None), torch.tensor([0.25]))


def test_elbo_estimator_is_unchanged_for_unpadded_inputs():
    """The valid mask of an unpadded batch draws the very same noise as no mask (old numbers stay comparable)."""
    table = torch.randn(V)
    fn = lambda x: table.expand(*x.shape, V) + x[..., None].float() * 0.01  # noqa: E731
    x0 = torch.randint(3, V, (4, 12))
    a = elbo_nll_per_token(fn, x0, 1, 4, torch.Generator().manual_seed(0))
    b = elbo_nll_per_token(fn, x0, 1, 4, torch.Generator().manual_seed(0), torch.ones_like(x0, dtype=torch.bool))
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "mode, over",
    [
        ("difflm-noshift", {"time_embedding": True, "time_conditioning": "adaln"}),
        ("difflm-noshift-uniform", {"time_embedding": True}),
        ("ar", {}),
    ],
)
def test_the_export_runs_in_bf16(mode, over):
    """LLaDA/Dream/MegaDLMs users load with torch_dtype=torch.bfloat16; fp32 RoPE tables made SDPA
    raise. The bf16 model's logits track the fp32 ones and every helper runs."""
    model = _model(mode, **over)
    x = torch.randint(3, V, (2, 16))
    t = torch.tensor([0.3, 0.7])
    ref = model(x, t=t).logits
    low = model.to(torch.bfloat16)
    got = low(x, t=t).logits
    assert got.dtype == torch.bfloat16 and (got.float() - ref).abs().max() < 0.05 * ref.abs().max()
    if mode == "ar":
        assert torch.isfinite(low.ar_nll(x)).all()
    else:
        assert torch.isfinite(low.elbo_nll(x, t_samples=2, generator=torch.Generator().manual_seed(0))).all()
        assert low.diffusion_generate(x[:, :4], length=4, steps=2).shape == (2, 8)
