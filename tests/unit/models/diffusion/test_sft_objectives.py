"""Instruction data (SFT): every objective noises and scores response tokens only, the prompt stays clean and
unscored, multi-turn rows train every assistant turn, and the loss is normalised over the response."""

from __future__ import annotations

import pytest
import torch

from difflm.models.diffusion.documents import document_ids
from difflm.models.diffusion.modes import MODES, objective_class

TOKENS = {"mask_id": 1, "vocab_size": 32, "pad_id": 2, "eos_id": 0}
EOS, MASK = 0, 1
S = 16

# row 0: a one-turn conversation (prompt 0-5, response 6-9 closed by EOS at 10), then the start of the next one
# (prompt 11-13, response 14-15 cut by the window); row 1: two assistant turns (4-6 + EOS 7, 11-13 + EOS 14)
RESPONSE = torch.zeros(2, S + 1, dtype=torch.bool)  # the window's s + 1 tokens: tokens and the last label
RESPONSE[0, 6:11] = RESPONSE[0, 14:17] = True
RESPONSE[1, 4:8] = RESPONSE[1, 11:15] = True
TURNS = {1: [range(4, 8), range(11, 15)]}

# every objective's variants that change where noise lands or what is scored
CASES = [
    ("difflm-noshift", {}),
    ("difflm-noshift", {"loss_weighting": "masked_fraction"}),
    ("difflm-shift", {}),
    ("difflm-shift", {"loss_weighting": "cart"}),
    ("difflm-noshift-uniform", {}),
    ("ar", {}),
    ("ar", {"mir_mask_share": 0.5}),
    ("difflm-block", {}),
    ("difflm-block", {"block_shift": True}),
    ("difflm-block", {"complementary_masks": True}),
    ("difflm-block", {"clean_attention": "token_causal", "ar_loss_weight": 1.0}),
]
IDS = [mode + "".join(f"-{k}={v}" for k, v in s.items()) for mode, s in CASES]


def window(seed: int = 0):
    """tokens, labels, label_ok [2, S] and the response masks of tokens and labels: ids 3.. with EOS where a
    response (or a prompt: row 0 position 5 is not one) ends."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, TOKENS["vocab_size"], (2, S + 1), generator=g)
    text[0, 10] = text[1, 7] = text[1, 14] = EOS
    return text[:, :-1], text[:, 1:], torch.ones(2, S, dtype=torch.bool), RESPONSE[:, :-1], RESPONSE[:, 1:]


def prepared(objective, evaluation: bool, step: int, seed: int = 0):
    """What the forward step hands the loss (`forward_step.corrupt`, without megatron)."""
    tokens, labels, label_ok, response, response_labels = window(seed)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": label_ok}
    batch = objective.response_view({**batch, "response": response, "response_labels": response_labels})
    tokens = batch["tokens"]
    out = objective.prepare(
        tokens,
        batch["labels"],
        batch["loss_mask"],
        [0, 1],
        lambda pos: torch.Generator().manual_seed(1000 * step + pos),
        2,
        False,
        evaluation,
        response=batch["response"],
    )
    return tokens, out


def predicted_response(objective, rows: int) -> torch.Tensor:
    """[rows, width] True where the objective's output predicts a response token: the logit of token i itself,
    or of token i + 1 where it is shifted (AR, difflm-shift, a shifted block model); block diffusion's clean
    half predicts the next token."""
    tokens_mask, labels_mask = RESPONSE[:, :-1], RESPONSE[:, 1:]
    if objective.two_stream:
        noisy = labels_mask if objective.block_shift else tokens_mask
        half = torch.cat([noisy, labels_mask], dim=1)
        return torch.cat([half] * (rows // 2))
    aligned = labels_mask if (objective.shifted or not objective.bidirectional) else tokens_mask
    return torch.cat([aligned] * (rows // 2))


def output_for(objective, out: dict, generator: torch.Generator) -> torch.Tensor:
    """A model output of the loss's shape: per-token CE [rows, width], or logits [rows, width, V] where the
    objective needs every logit."""
    rows, width = out["inputs"].shape
    if objective.full_logits:
        return torch.randn(rows, width, TOKENS["vocab_size"], generator=generator)
    return torch.rand(rows, width, generator=generator) * 3


@pytest.mark.parametrize("evaluation", [False, True], ids=["train", "valid"])
@pytest.mark.parametrize(("mode", "settings"), CASES, ids=IDS)
def test_noise_and_loss_touch_response_tokens_only(mode, settings, evaluation):
    objective = objective_class(mode)(**TOKENS, **settings)
    g = torch.Generator().manual_seed(7)
    moved_by_response = False
    for step in range(6):
        tokens, out = prepared(objective, evaluation, step)
        rows = out["inputs"].shape[0]
        clean = torch.cat([tokens] * (rows // len(tokens)))
        noisy = out["inputs"][:, : tokens.shape[1]]  # block diffusion: the noisy half of [x_t | x_0]
        changed = noisy != clean
        response = torch.cat([RESPONSE[:, :-1]] * (rows // 2))
        assert not (changed & ~response).any(), "noise touched a prompt token"
        if objective.two_stream:
            assert torch.equal(out["inputs"][:, tokens.shape[1] :], clean), "the clean half stays clean"
        # the loss terms: an output that predicts a prompt token never moves them, one that predicts a response
        # token does (on some draw); the count is the response's
        output = output_for(objective, out, g)
        total, count = objective.loss_terms(output, out, evaluation)
        target = predicted_response(objective, rows)
        assert target.shape == output.shape[:2]
        bump = torch.randn(output.shape[2:], generator=g) * 3 + 5  # logits: a non-constant shift moves the softmax
        bumped = output.clone()
        bumped[~target] += bump
        assert torch.allclose(objective.loss_terms(bumped, out, evaluation)[0], total), "a prompt logit counted"
        bumped = output.clone()
        bumped[target] += bump
        moved_by_response |= not torch.allclose(objective.loss_terms(bumped, out, evaluation)[0], total)
        assert 0 < int(count) <= int(target.sum())
    assert moved_by_response, "the response tokens never reached the loss"


@pytest.mark.parametrize(("mode", "settings"), CASES, ids=IDS)
def test_multi_turn_rows_noise_and_score_every_assistant_turn(mode, settings):
    """Over a few draws each assistant turn of the two-turn row is noised (or, AR, scored) somewhere."""
    objective = objective_class(mode)(**TOKENS, **settings)
    hit = {turn: False for turn in range(2)}
    for step in range(12):
        tokens, out = prepared(objective, False, step)
        if "mir_masked" in out:  # AR + MIR: the masked inputs of its copy
            row = out["mir_masked"][1]
        elif objective.bidirectional:  # diffusion: the noised tokens (of the first mask of a complementary pair)
            row = (out["inputs"][:, : tokens.shape[1]] != torch.cat([tokens] * (len(out["inputs"]) // 2)))[1]
        else:  # AR: the scored next tokens, moved onto the tokens they are
            row = torch.cat([torch.zeros(1, dtype=torch.bool), out["scored"][1, :-1].bool()])
        for turn, span in enumerate(TURNS[1]):
            hit[turn] |= bool(row[list(span)].any())
    assert all(hit.values()), hit


def test_masked_sft_loss_is_one_over_t_normalised_over_the_response():
    """LLaDA's SFT loss: sum over masked response tokens of CE / t, divided by the response length (not the
    window's, not the masked count); with CE = 1 everywhere the sum is #masked / t per row."""
    objective = MODES["difflm-noshift"](**TOKENS)
    tokens, out = prepared(objective, False, step=3)
    response = RESPONSE[:, :-1]
    masked = out["inputs"].eq(MASK)
    assert torch.equal(out["scored"], masked) and not (masked & ~response).any()
    total, count = objective.loss_terms(torch.ones(2, S), out, False)
    assert int(count) == int(response.sum())
    assert float(total) == pytest.approx(float((masked.sum(-1) / out["t"]).sum()), rel=1e-5)


def test_validation_is_the_conditional_elbo_of_the_response():
    """Validation masks exactly ceil(t n) of a row's n response tokens and weighs them n / count: the discrete
    conditional ELBO of the response given the clean prompt."""
    objective = MODES["difflm-noshift"](**TOKENS)
    _, out = prepared(objective, True, step=5)
    n = RESPONSE[:, :-1].sum(-1)
    counts = (out["t"] * n).ceil().clamp(min=1).long()
    assert torch.equal(out["scored"].sum(-1), counts)
    total, count = objective.loss_terms(torch.ones(2, S), out, True)
    assert (float(total), int(count)) == (pytest.approx(float(n.sum())), int(n.sum()))  # each row: n / c * c


def test_eos_fill_pads_the_window_tail_with_scored_eos_in_the_conversations_document():
    """sft_eos=fill (LLaDA): after a row's last response EOS every token is EOS, scored as response, and the run
    stays in the conversation's document; sft_eos=turn leaves the packed tokens as they are."""
    tokens, labels, label_ok, response, response_labels = window()
    documents = torch.zeros(2, S, dtype=torch.long)
    documents[0, 11:] = 1  # row 0: the next conversation starts after the EOS at 10
    batch = {"tokens": tokens, "labels": labels, "loss_mask": label_ok, "documents": documents}
    batch.update(response=response, response_labels=response_labels)
    filled = MODES["difflm-noshift"](**TOKENS, sft_eos="fill").response_view(batch)
    x, y, ok, resp = (filled[k] for k in ("tokens", "labels", "loss_mask", "response"))
    assert torch.equal(x[0, 11:], torch.full((5,), EOS)) and torch.equal(x[0, :11], tokens[0, :11])
    assert torch.equal(x[1, 15:], torch.full((1,), EOS)) and torch.equal(x[1, :15], tokens[1, :15])
    assert resp[0, 11:].all() and not resp[0, :6].any()
    assert torch.equal(y[:, :-1], x[:, 1:]) and ok[0, 10:].all() and not ok[0, :5].any()
    assert filled["documents"][0].tolist() == [0] * S  # the fill belongs to the conversation it closes
    assert document_ids(x, EOS)[0].tolist() == [0] * S  # also where documents come from EOS
    kept = MODES["difflm-noshift"](**TOKENS).response_view(batch)
    assert torch.equal(kept["tokens"], tokens) and torch.equal(kept["response"], response)
    assert torch.equal(kept["loss_mask"], response_labels) and torch.equal(kept["documents"], documents)


def test_a_run_of_eos_ends_one_document():
    x = torch.tensor([[5, 6, EOS, EOS, EOS, 7, 8, EOS, 9]])
    assert document_ids(x, EOS).tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 2]]
