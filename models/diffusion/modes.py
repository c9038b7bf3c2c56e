"""The objective of each mode as one object: what training, evaluation, the export and the FLOPs count ask of it.

Pure torch, shipped flat in every export folder (relative imports only). One class per mode; each owns:
1. its corruption of a training / validation micro-batch and the positions it scores (`prepare`),
2. its training loss terms and its validation bound as (sum, count) (`loss_terms`),
3. its evaluation bound per token on the same tokens for every family: tokens 1.. given token 0 (`nll_per_token`),
4. its conditional likelihood and greedy check (`conditional_nll`, `greedy_match`: None where undefined),
5. its sampler (`sample`),
6. the facts callers need, as class attributes: `bidirectional` (attention both ways), `uses_t` (time
   conditioning applies), `requires_t` (the inputs do not reveal t: callers must pass it), `shifted` (logit i
   predicts token i + 1), `full_logits` (the loss needs every logit, not megatron's per-token cross-entropy),
   `exact` (its likelihood is exact, not a bound), `has_greedy`, `unmasks` (the masked sampler's settings and
   steps apply), `varilen` (variable-length training applies),
   `attention_flops_factor` (the share of the s x s attention core a kernel computes); `time_conditioned`
   answers whether t reaches the network.

Each class carries its family's settings as frozen dataclass fields (the tokenizer's ids are on the base). A
process reads the config's mode once (`build_objective`) and passes the object on; an export records it as one
entry (`Objective.to_dict`) read back by `objective_from_dict`.

The formulas live in the modules beside this one (`objectives`, `bounds`, `conditional`, `samplers`, `uniform`);
an objective composes them. Nothing outside this module compares the mode string: adding a mode is one class here
(registered in `MODES`) plus its tests. Its settings (`setting`: default, description, bounds, identity marking;
`Literal` annotations for choices) are the config's `diffusion` section for that mode (difflm/config/diffusion.py builds
it from them).

Logits functions all take (tokens [b, s], t [b] or None) and return logits [b, s, V] aligned with the positions
they predict (`align_logits` undoes the shift of `difflm-shift`); the conditional ones also take the attention
mask and document ids of the rows they are given.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal

import torch

from .blocks import (
    attention_pairs,
    block_counts,
    block_elbo_terms,
    block_greedy_match,
    mask_per_block,
    two_stream_keep,
)
from .bounds import ar_nll_per_token, elbo_nll_per_token, uniform_elbo_nll_per_token
from .conditional import conditional_ar_nll, conditional_masked_nll, masked_greedy_match
from .noise import mask_exactly, mask_tokens, stratified_t, uniform_corrupt
from .objectives import Weighting, cart_weights, masked_diffusion_loss_terms, shift_targets, x0_cross_entropy_terms
from .samplers import MaskedSampler, sample_masked_diffusion, sample_uniform_diffusion
from .sft import SftEos, response_view
from .uniform import (
    mixture_t,
    mixture_weight,
    nelbo_integrand,
    reconstruction_nll,
    state_index,
    state_log_probs,
    uniform_states,
)

TimedLogitsFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
# (tokens [n, s], attention_mask [n, s] or None, document_ids [n, s] or None, t [n] or None) -> logits [n, s, V]
RowLogitsFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None], torch.Tensor]
GeneratorFor = Callable[[int], torch.Generator]  # the position of a sequence in the global batch -> its generator


IF_SET = "if_set"  # identity marking (difflm/config/base.py): joins the run's name only when set to another value


def setting(default, description: str, identity: str | bool | None = None, **bounds):
    """A mode's setting: its default, its description and bounds (ge / gt / le / lt) and how it names a run
    (`identity`: IF_SET, or False for an operational one); the config's `diffusion` section is built from these."""
    metadata = {"description": description, **bounds}
    if identity is not None:
        metadata["identity"] = identity
    return field(default=default, metadata=metadata)


# A setting shared by several modes, declared once each (the default and the values it takes).
def _eps():
    return setting(1e-3, "t ~ U(eps, 1): lower bound of the noise level.", gt=0.0, lt=1.0)


# the config's `diffusion.loss_weighting`: which weights, by name (cart: Dream's, computed per token; the loss
# function is told only how to apply them: `MaskedDiffusion.training_weighting`)
LossWeighting = Literal["inverse_t", "masked_fraction", "none", "cart"]


def _loss_weighting():
    return setting(
        "inverse_t",
        "Weight of masked-token CE: inverse_t (LLaDA: Bernoulli(t) masks, weight 1/t); masked_fraction "
        "(MegaDLMs-style L/#masked, with exactly ceil(tL) masks so it stays an unbiased ELBO); none (not a bound); "
        "cart (difflm-shift only: Dream's context-adaptive token reweighting, each masked token weighted by "
        "0.5 * sum over clean tokens i of p(1-p)^(|n-i|-1), p = cart_p; not a bound). Validation reports the ELBO "
        "whatever the weighting.",
    )


def _normalize_by():
    return setting("all_tokens", "all_tokens: LLaDA/MegaDLMs convention (an ELBO); masked_tokens: mean over masked.")


TOKEN_FIELDS = ("mask_id", "vocab_size", "pad_id", "eos_id")  # facts of the tokenizer, not settings of a mode


@dataclass(frozen=True)
class Objective(ABC):
    """The tokenizer's ids every objective may read; each family adds its own settings as fields (`settings`);
    facts are class attributes."""

    mask_id: int | None = None
    vocab_size: int | None = None  # the tokenizer's (real) vocabulary: uniform noise draws among it
    pad_id: int | None = None
    eos_id: int | None = None
    sft_eos: SftEos = setting(
        "turn",
        "Instruction data (SFT) only: turn scores the EOS that closes each response, as data prep packed it "
        "(nothing padded); fill (LLaDA's SFT) turns the window's tail after its last response EOS into EOS, scored "
        "as response, so the model learns to fill a generation window with EOS after its answer (the cut start of "
        "the next conversation is dropped). Pretraining data ignores it.",
        identity=IF_SET,
    )

    name: ClassVar[str] = ""
    bidirectional: ClassVar[bool] = True
    uses_t: ClassVar[bool] = True
    requires_t: ClassVar[bool] = False
    shifted: ClassVar[bool] = False
    full_logits: ClassVar[bool] = False
    exact: ClassVar[bool] = False
    has_greedy: ClassVar[bool] = True
    unmasks: ClassVar[bool] = False  # its sampler unmasks step by step: the masked sampler's settings apply
    varilen: ClassVar[bool] = True
    two_stream: ClassVar[bool] = False  # the model runs on [x_t | x_0] (2L tokens) under `two_stream_keep`

    @staticmethod
    def _id(value: int | None, name: str) -> int:
        """A tokenizer id this objective needs (an objective built without its tokenizer cannot corrupt tokens)."""
        if value is None:
            raise ValueError(f"this objective was built without the tokenizer's {name}: pass it to build_objective")
        return value

    @classmethod
    def settings(cls) -> tuple[str, ...]:
        """The names of this mode's settings: its fields but the tokenizer's ids."""
        return tuple(f.name for f in fields(cls) if f.name not in TOKEN_FIELDS)

    def time_conditioned(self, time_embedding: bool) -> bool:
        """Whether the network takes t: `time_embedding` is asked for and the mode has one t per sequence."""
        return bool(time_embedding) and self.uses_t

    @classmethod
    def check_model(cls, backend: str, time_embedding: bool, attention_anneal_steps: int) -> None:
        """Refuse the shared settings and model back-ends this mode cannot train with (the config asks this when
        it validates; the mode's own settings are checked by the class's construction)."""
        if attention_anneal_steps and not cls.bidirectional:
            raise ValueError(
                f"diffusion.attention_anneal_steps anneals towards full attention: not with mode {cls.name}"
            )

    def to_dict(self) -> dict:
        """{'mode': name, setting: value, ...}: what an export records of its objective (`objective_from_dict`)."""
        return {"mode": self.name, **{name: getattr(self, name) for name in self.settings()}}

    @classmethod
    def attention_flops_factor(cls) -> float:
        """Causal kernels skip the tiles above the diagonal (about half of s x s); bidirectional ones do all."""
        return 1.0 if cls.bidirectional else 0.5

    def model_tokens(self, seq_len: int) -> int:
        """Tokens the network processes for a sequence of `seq_len` (its matmuls and LM head count these)."""
        return seq_len

    def attention_pairs(self, seq_len: int) -> float:
        """(query, key) pairs the attention kernel computes for a sequence of `seq_len`."""
        return seq_len * seq_len * self.attention_flops_factor()

    def rows_per_sequence(self, evaluation: bool) -> int:
        """Model rows `prepare` makes of one sequence (complementary masks train each sequence twice): megatron's
        micro-batch shape and the FLOPs count scale by it."""
        return 1

    # ---- positions -------------------------------------------------------------------------------------
    def align_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits aligned with the positions they predict (identity but for the shifted mode)."""
        return logits

    def scored_positions(self, valid: torch.Tensor, prefix_len: int = 0) -> torch.Tensor:
        """The positions a bound scores: `valid` [b, s] without the first `prefix_len` (kept as clean context)."""
        scored = valid.bool().clone()
        if prefix_len:
            scored[:, :prefix_len] = False
        return scored

    def default_t(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The noise level of inputs given without one: the share of mask tokens among the real positions (the
        quantity training's t is the expectation of)."""
        masks = input_ids.eq(self._id(self.mask_id, "mask_id")).float()
        if attention_mask is None:
            return masks.mean(-1)
        real = attention_mask.float()
        return (masks * real).sum(-1) / real.sum(-1).clamp(min=1)

    # ---- training and validation -----------------------------------------------------------------------
    def response_view(self, batch: dict) -> dict:
        """A micro-batch of instruction data as this objective trains on it (`sft.response_view`: `loss_mask`
        restricted to response labels, `sft_eos` applied); then `prepare(..., response=batch["response"])`."""
        return response_view(batch, self.eos_id, self.sft_eos)

    @abstractmethod
    def prepare(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        label_ok: torch.Tensor,
        positions: list[int],
        generator_for: GeneratorFor,
        batch_size: int,
        antithetic: bool,
        evaluation: bool,
        response: torch.Tensor | None = None,
    ) -> dict:
        """Model inputs, targets, scored positions and t of one micro-batch: {'inputs', 'targets', 'scored',
        'valid', 't'} (and what `loss_terms` needs besides; 'row_tokens', the clean tokens of each model row, where
        `rows_per_sequence` makes several). `label_ok` [b, s] is megatron's loss_mask
        (labels[i] = tokens[i + 1] is data); `positions` are the sequences' places in the global batch of
        `batch_size`, which key their noise (`generator_for`) and their stratum of t.

        Instruction data (`response` [b, s], and `label_ok` restricted to response labels, as `response_view`
        gives them as `response` and `loss_mask`): the prompt stays clean and unscored; noise, loss terms and the count (the normaliser of
        1/t) cover response tokens only, so validation reports the conditional bound of the responses."""

    @abstractmethod
    def loss_terms(self, output: torch.Tensor, prepared: dict, evaluation: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum, count) of the loss of a micro-batch (megatron divides by the global count). `output` is the
        per-token cross-entropy [b, s], or the logits [b, s, V] where `full_logits`."""

    # ---- evaluation and generation -----------------------------------------------------------------------
    @abstractmethod
    def nll_per_token(
        self,
        logits_fn: TimedLogitsFn,
        x0: torch.Tensor,
        scored: torch.Tensor,
        t_samples: int,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        """The NLL per scored token [b] (nats) of each row of x0: an upper bound (ELBO), or exact where `exact`.
        A row with nothing to score has no per-token value: NaN."""

    @abstractmethod
    def conditional_nll(
        self,
        logits_fn: RowLogitsFn,
        x0: torch.Tensor,
        target: torch.Tensor,
        attention_mask: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        mc_samples: int,
        generators,
        max_rows: int,
    ) -> torch.Tensor:
        """-log p(continuation | context) in total nats per row [b] (float64, CPU); `target` marks the
        continuation."""

    def greedy_match(
        self,
        logits_fn: RowLogitsFn,
        x0: torch.Tensor,
        target: torch.Tensor,
        attention_mask: torch.Tensor | None,
        document_ids: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Would greedy decoding reproduce the continuation? [b] bool, or None where the mode has no greedy order."""
        return None


def _exact_noise_rows(tokens, noisable, positions, generator_for, batch_size, eps, antithetic, draw):
    """Per sequence: its generator, its stratified t in [eps, 1], then `draw(row, ok, t, g)` -> (x_t, flag)."""
    rows, ts, flags = [], [], []
    for row, ok, pos in zip(tokens, noisable, positions):
        g = generator_for(pos)
        t = stratified_t(torch.rand(1, generator=g), torch.tensor([pos]), batch_size, eps, antithetic)
        xt, flag, t = draw(row[None], ok[None], t, g)
        rows.append(xt), ts.append(t), flags.append(flag)
    return torch.cat(rows), torch.cat(ts), torch.cat(flags)


def _data_positions(label_ok: torch.Tensor, response: torch.Tensor | None = None) -> torch.Tensor:
    """tokens[i] is data iff labels[i - 1] is (token 0 always is): the positions a no-shift objective scores;
    with instruction data only the `response` tokens among them."""
    data = torch.cat([torch.ones_like(label_ok[:, :1]), label_ok[:, :-1]], dim=1).bool()
    return data if response is None else data & response.bool()


@dataclass(frozen=True)
class MaskedDiffusion(Objective):
    """Masked diffusion, bidirectional (MegaDLMs' difflm-noshift; LLaDA/MDLM): tokens are replaced by the mask
    at rate t ~ U(eps, 1); the loss is the cross-entropy on masked positions weighted by 1/t (or L/#masked);
    validation and evaluation report the discrete ELBO (exactly ceil(t L) masks, weight L/#masked)."""

    eps: float = _eps()
    loss_weighting: LossWeighting = _loss_weighting()
    normalize_by: Literal["all_tokens", "masked_tokens"] = _normalize_by()

    name = "difflm-noshift"
    unmasks = True

    def __post_init__(self):
        if self.loss_weighting == "cart" and not self.shifted:
            raise ValueError(
                f"loss_weighting=cart (Dream's CART) needs model_running_mode=difflm-shift, not {self.name}"
            )

    def _noisable(self, valid: torch.Tensor) -> torch.Tensor:
        """The positions noise may mask with exact counts: every data token."""
        return valid

    def _exact_counts(self, evaluation: bool) -> bool:
        """Exactly ceil(t L) masks (LLaDA's discrete ELBO) in evaluation, and in training with masked_fraction
        weighting, whose L/#masked weight is unbiased only for counts uniform on {1..L}."""
        return evaluation or self.loss_weighting == "masked_fraction"

    def prepare(
        self, tokens, labels, label_ok, positions, generator_for, batch_size, antithetic, evaluation, response=None
    ):
        valid = _data_positions(label_ok, response)
        exact = self._exact_counts(evaluation)

        def draw(row, ok, t, g):
            if exact:
                n_valid = int(ok.sum())
                count = (t * n_valid).ceil().clamp(1, max(n_valid, 1)).long()
                return (*mask_exactly(row, count, self.mask_id, g, ok), t)
            _, masked = mask_tokens(row, t, self.mask_id, g)
            masked = masked & ok  # only noisable tokens: never a prompt token, nor token 0 of a shifted mode
            return torch.where(masked, torch.full_like(row, self.mask_id), row), masked, t

        xt, t, masked = _exact_noise_rows(
            tokens,
            self._noisable(valid),
            positions,
            generator_for,
            batch_size,
            self.eps,
            antithetic or evaluation,
            draw,
        )
        return self._targets(tokens, xt, masked, valid, label_ok, t, _data_positions(label_ok))

    def _targets(self, x0, xt, masked, valid, label_ok, t, context) -> dict:
        return {"inputs": xt, "targets": x0, "scored": masked & valid, "valid": valid, "t": t}

    def training_weighting(self) -> Weighting:
        """How the training loss applies `loss_weighting`: CART's weights are per token (`_targets` puts them in
        the batch as `token_weights`), the others per sequence."""
        return "per_token" if self.loss_weighting == "cart" else self.loss_weighting

    def loss_terms(self, output, prepared, evaluation):
        weighting, normalize_by = (
            ("masked_fraction", "all_tokens")
            if evaluation  # the ELBO, whatever the training
            else (self.training_weighting(), self.normalize_by)
        )
        return masked_diffusion_loss_terms(
            output.float(),
            prepared["scored"],
            prepared["t"],
            weighting,
            normalize_by,
            prepared["valid"],
            prepared["token_weights"] if weighting == "per_token" else None,
        )

    def nll_per_token(self, logits_fn, x0, scored, t_samples, generator):
        return _nan_if_empty(
            elbo_nll_per_token(lambda x: logits_fn(x, None), x0, self.mask_id, t_samples, generator, scored), scored
        )

    def conditional_nll(self, logits_fn, x0, target, attention_mask, document_ids, mc_samples, generators, max_rows):
        return conditional_masked_nll(
            lambda x, m, d: logits_fn(x, m, d, None),
            x0,
            target,
            self.mask_id,
            mc_samples,
            generators,
            attention_mask,
            max_rows,
            document_ids,
        )

    def greedy_match(self, logits_fn, x0, target, attention_mask, document_ids):
        return masked_greedy_match(
            lambda x, m, d: logits_fn(x, m, d, None),
            x0,
            target,
            self.mask_id,
            attention_mask,
            self.vocab_size,
            document_ids,
        )

    def sample(
        self,
        logits_fn: TimedLogitsFn,
        prompt: torch.Tensor,
        length: int,
        settings: MaskedSampler,
        generator=None,
        forbidden_ids: tuple[int, ...] = (),
        stats: dict | None = None,
    ) -> torch.Tensor:
        """Iterative unmasking (LLaDA and its extensions, see `MaskedSampler`). Returns [b, p + length]."""
        if self.mask_id is None:
            raise ValueError("config.mask_token_id is not set: this export cannot run the diffusion sampler")
        return sample_masked_diffusion(
            lambda x: logits_fn(x, None),
            prompt,
            length,
            self.mask_id,
            settings.steps,
            vocab_limit=self.vocab_size,
            temperature=settings.temperature,
            generator=generator,
            forbidden_ids=forbidden_ids,
            settings=settings,
            eos_id=self.eos_id,
            stats=stats,
        )


@dataclass(frozen=True)
class ShiftedMaskedDiffusion(MaskedDiffusion):
    """Masked diffusion whose logit i predicts token i + 1 (MegaDLMs' difflm-shift; Dream), so an AR
    checkpoint's head keeps its meaning. No logit predicts token 0: it is never scored, and validation and
    evaluation condition on it (masks drawn among tokens 1..L-1, normalised by L - 1)."""

    cart_p: float = setting(
        0.3, "loss_weighting=cart: the geometric parameter p (Dream: 0.3).", identity=IF_SET, gt=0.0, le=1.0
    )

    name = "difflm-shift"
    shifted = True

    def _noisable(self, valid):
        noisable = valid.clone()
        noisable[:, 0] = False  # no logit predicts token 0: masking it would hide context without scoring it
        return noisable

    def _targets(self, x0, xt, masked, valid, label_ok, t, context):
        # scored on the next token: its validity is megatron's own label mask (the first padding token, the
        # target of the last data position, is never scored); the last position has no next token here
        targets, scored = shift_targets(x0, masked)
        next_ok = label_ok.bool().clone()
        next_ok[:, -1] = False
        out = {"inputs": xt, "targets": targets, "scored": scored & next_ok, "valid": next_ok, "t": t}
        if self.loss_weighting == "cart":  # weights of the masked tokens, moved onto the logits that predict them
            weights = cart_weights(masked & valid, context, self.cart_p)  # a clean prompt token is context too
            out["token_weights"] = torch.cat([weights[:, 1:], torch.zeros_like(weights[:, :1])], dim=1)
        return out

    def align_logits(self, logits):
        return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)

    def scored_positions(self, valid, prefix_len=0):
        return super().scored_positions(valid, max(prefix_len, 1))

    def conditional_nll(self, logits_fn, x0, target, attention_mask, document_ids, mc_samples, generators, max_rows):
        if target[:, 0].any():
            raise ValueError("a difflm-shift model cannot score token 0: give it at least one context token")
        return super().conditional_nll(
            logits_fn, x0, target, attention_mask, document_ids, mc_samples, generators, max_rows
        )

    def sample(self, logits_fn, prompt, length, settings, generator=None, forbidden_ids=(), stats=None):
        if prompt.shape[1] == 0:
            raise ValueError("a difflm-shift model needs at least one prompt token (each position predicts the next)")
        return super().sample(logits_fn, prompt, length, settings, generator, forbidden_ids, stats)


@dataclass(frozen=True)
class UniformDiffusion(Objective):
    """Uniform-state diffusion (UDLM/DUO; this project's difflm-noshift-uniform): tokens are replaced at rate t by
    uniform draws over the states (the vocabulary without mask and pad). The loss is UDLM's continuous-time NELBO
    (t from `mixture_t`, weighted back), or plain x0 cross-entropy (`uniform_loss=x0_ce`, not a bound); validation
    adds the exact last step eps -> 0, so it is an upper bound like the evaluation bound."""

    eps: float = _eps()
    uniform_loss: Literal["elbo", "x0_ce"] = setting(
        "elbo",
        "elbo: UDLM's continuous-time ELBO (a bound, the default); x0_ce: plain cross-entropy of the clean token at "
        "every position (UDLM's simple-CE ablation, a denoiser surrogate, not a bound).",
    )

    name = "difflm-noshift-uniform"
    requires_t = True
    full_logits = True
    has_greedy = False  # no greedy order: every position is always some token

    def states(self, device=None) -> torch.Tensor:
        return uniform_states(self._id(self.vocab_size, "vocab_size"), self.mask_id, self.pad_id, device or "cpu")

    def default_t(self, input_ids, attention_mask):
        raise ValueError(
            "a time-conditioned uniform-noise model needs the noise level: pass t=[b] "
            "(elbo_nll and diffusion_generate do)"
        )

    def prepare(
        self, tokens, labels, label_ok, positions, generator_for, batch_size, antithetic, evaluation, response=None
    ):
        valid = _data_positions(label_ok, response)
        states = self.states()
        # Validation adds the reconstruction term -log p(x0 | z_eps) as a point mass of the importance distribution
        # over t: the sequences in the first 1/n of the stratified range (one per global batch) are scored at
        # t = eps on it, weight n; the others on the integral over [eps, 1], weight mixture_weight / (1 - 1/n).
        share = 1.0 / max(batch_size, 2) if evaluation else 0.0
        recon, weight = [], []

        def draw(row, ok, t, g):
            v = (t - self.eps) / (1 - self.eps)  # back to the stratified uniform
            last_step = bool(v < share)
            t = torch.full_like(t, self.eps) if last_step else mixture_t((v - share) / (1 - share), self.eps)
            recon.append(last_step)
            weight.append(1.0 / share if last_step else float(mixture_weight(t, self.eps)) / (1 - share))
            xt, corrupted = uniform_corrupt(row, t, states, g)
            corrupted = corrupted & ok  # noise touches the scored tokens only (a prompt stays clean)
            return torch.where(corrupted, xt, row), corrupted, t

        xt, t, corrupted = _exact_noise_rows(
            tokens, valid, positions, generator_for, batch_size, self.eps, antithetic or evaluation, draw
        )
        return {
            "inputs": xt,
            "targets": tokens,
            "scored": corrupted & valid,
            "valid": valid,
            "t": t,
            "last_step": torch.tensor(recon),
            "weight": torch.tensor(weight, dtype=torch.float64),
        }

    def loss_terms(self, output, prepared, evaluation):
        states = self.states(output.device)
        x0, xt = prepared["targets"], prepared["inputs"]
        x0_idx = state_index(x0, states, output.shape[-1])
        valid = prepared["valid"] & (x0_idx >= 0)  # a target outside the states (pad) cannot be scored
        log_p = state_log_probs(output, states)  # [b, s, N]
        x0_idx = x0_idx.clamp(min=0)
        if self.uniform_loss == "x0_ce" and not evaluation:
            ce = -log_p.gather(-1, x0_idx[..., None]).squeeze(-1)
            return x0_cross_entropy_terms(ce, valid)
        xt_idx = state_index(xt, states, output.shape[-1]).clamp(min=0)
        t = prepared["t"].to(output.device)
        last = prepared["last_step"].to(output.device)[:, None]
        per_token = nelbo_integrand(log_p, x0_idx, xt_idx, t)
        if last.any():  # validation: the rows scored on the last step eps -> 0
            per_token = torch.where(last, reconstruction_nll(log_p, x0_idx, xt_idx, t), per_token)
        total = ((per_token * valid).sum(-1) * prepared["weight"].to(output.device)).sum()
        return total.to(torch.float32), valid.sum().to(torch.int)

    def nll_per_token(self, logits_fn, x0, scored, t_samples, generator):
        return _nan_if_empty(
            uniform_elbo_nll_per_token(logits_fn, x0, self.states(x0.device), t_samples, self.eps, generator, scored),
            scored,
        )

    def conditional_nll(self, logits_fn, x0, target, attention_mask, document_ids, mc_samples, generators, max_rows):
        gens = generators if isinstance(generators, (list, tuple)) else [generators] * len(x0)
        out = []
        for i, g in enumerate(gens):  # one row at a time: each row's t draws come from its own generator
            rows = slice(i, i + 1)
            m = None if attention_mask is None else attention_mask[rows]
            d = None if document_ids is None else document_ids[rows]
            per_tok = uniform_elbo_nll_per_token(
                lambda x, t, m=m, d=d: logits_fn(x, m, d, t),
                x0[rows],
                self.states(x0.device),
                mc_samples,
                self.eps,
                g,
                target[rows],
            )
            out.append(per_tok.double() * int(target[i].sum()))
        return torch.cat(out)

    def sample(self, logits_fn, prompt, length, settings, generator=None, forbidden_ids=(), stats=None):
        """The ancestral sampler of the reverse chain (`settings.steps` steps at `settings.temperature`)."""
        if stats is not None:
            stats["nfe"] = max(1, settings.steps)  # one model call per step
        return sample_uniform_diffusion(
            logits_fn,
            prompt,
            length,
            settings.steps,
            self.states(prompt.device),
            temperature=settings.temperature,
            generator=generator,
        )


@dataclass(frozen=True)
class Autoregressive(Objective):
    """The causal baseline: next-token cross-entropy on megatron's labels; exact likelihood; no noise level.

    `mir_mask_share` turns on masked-input regularisation (MIR, Xu et al. 2026, arXiv 2606.06888): training
    adds a second row per sequence whose inputs have each data token replaced by the mask with that probability
    (drawn from the sequence's own generator), scored on the same clean next tokens; the loss is the clean CE plus
    `mir_weight` times the masked-input CE, both over the clean row's token count. Validation, the likelihood and
    sampling see clean inputs only (one row), so the NLL stays exact. One difference from Xu et al.'s code
    (dcp/train4_diffusionauxiliary_impl.py): they never mask a window's first 8 positions (`ltr_length`); this
    masks any data position, the first included (6% more positions at seq 128, 0.4% at 2,048)."""

    mir_mask_share: float = setting(
        0.0,
        "MIR (masked-input regularisation, Xu et al. 2026): the probability that each input token of the auxiliary "
        "copy is replaced by the mask token; its next-token CE on the clean targets is added to the loss "
        "(training runs two rows per sequence: twice the FLOPs). 0: off. Xu et al. draw a share in [0, 0.5] "
        "per sequence (mean 0.25).",
        identity=IF_SET,
        ge=0.0,
        lt=1.0,
    )
    mir_weight: float = setting(
        1.0,
        "MIR: weight of the masked-input CE added to the clean CE (Xu et al. use 0.4); needs mir_mask_share > 0.",
        identity=IF_SET,
        ge=0.0,
    )
    mir_share_draw: Literal["fixed", "uniform"] = setting(
        "fixed",
        "MIR: fixed masks every sequence's tokens with probability mir_mask_share; uniform draws that probability "
        "per sequence from [0, 2 x mir_mask_share] (Xu et al.: [0, 0.5], i.e. mir_mask_share=0.25), so some copies "
        "are barely masked and some heavily. uniform needs mir_mask_share <= 0.5.",
        identity=IF_SET,
    )

    name = "ar"
    bidirectional = False
    uses_t = False
    exact = True
    varilen = False  # the baseline always sees full windows

    def __post_init__(self):
        if not 0.0 <= self.mir_mask_share < 1.0:
            raise ValueError(
                f"diffusion.mir_mask_share={self.mir_mask_share} is a share of the input tokens: set it in [0, 1) "
                "(0 turns MIR off)"
            )
        if (self.mir_weight != 1.0 or self.mir_share_draw != "fixed") and not self.mir_mask_share:
            raise ValueError(
                "diffusion.mir_weight and diffusion.mir_share_draw shape the masked-input (MIR) loss, which is off: "
                "set diffusion.mir_mask_share > 0 (e.g. 0.25), or leave them out"
            )
        if self.mir_share_draw == "uniform" and self.mir_mask_share > 0.5:
            raise ValueError(
                f"diffusion.mir_share_draw=uniform draws each sequence's share from [0, 2 x mir_mask_share]: "
                f"mir_mask_share={self.mir_mask_share} would pass 1; set it to 0.5 or less (Xu et al.: 0.25)"
            )

    def rows_per_sequence(self, evaluation):
        return 2 if self.mir_mask_share and not evaluation else 1

    def prepare(
        self, tokens, labels, label_ok, positions, generator_for, batch_size, antithetic, evaluation, response=None
    ):
        # instruction data: label_ok marks the response's next tokens only (`response_view`)
        out = {"inputs": tokens, "targets": labels, "scored": label_ok, "valid": label_ok, "t": None}
        if self.rows_per_sequence(evaluation) == 1:
            return out
        masked = self.mir_masks(_data_positions(label_ok, response), positions, generator_for).to(tokens.device)
        noisy = torch.where(masked, torch.full_like(tokens, self._id(self.mask_id, "mask_id")), tokens)
        return {
            **out,
            "inputs": torch.cat([tokens, noisy]),  # [2b, s]: the clean rows, then their masked copies
            "targets": torch.cat([labels, labels]),
            "row_tokens": torch.cat([tokens, tokens]),  # each row's clean tokens: its documents' boundaries
            "mir_masked": masked,
        }

    def mir_masks(self, data: torch.Tensor, positions: list[int], generator_for: GeneratorFor) -> torch.Tensor:
        """[b, s] bool: the input tokens MIR masks, each data token with probability `mir_mask_share` (or, drawn
        `uniform`, a share of the sequence's own), from its sequence's generator (so every parallel layout and a
        resumed run draw the same)."""
        rows = []
        for ok, pos in zip(data, positions):
            gen = generator_for(pos)
            share = self.mir_mask_share
            if self.mir_share_draw == "uniform":
                share = 2 * share * float(torch.rand((), generator=gen))
            rows.append(torch.rand(ok.shape[0], generator=gen) < share)
        return torch.stack(rows).to(data.device) & data.bool()

    def loss_terms(self, output, prepared, evaluation):
        output = output.float()
        valid = prepared["valid"]
        if "mir_masked" not in prepared:  # one row per sequence (MIR off, or validation): the clean CE alone
            return x0_cross_entropy_terms(output, valid)
        clean, noisy = output[: len(valid)], output[len(valid) :]
        total, count = x0_cross_entropy_terms(clean, valid)
        return total + self.mir_weight * x0_cross_entropy_terms(noisy, valid)[0], count

    def scored_positions(self, valid, prefix_len=0):
        return valid.bool()  # token 0 has no logit; ar_nll_per_token scores 1.. of these

    def nll_per_token(self, logits_fn, x0, scored, t_samples, generator):
        return _nan_if_empty(ar_nll_per_token(lambda x: logits_fn(x, None), x0, scored), scored[:, 1:])

    def conditional_nll(self, logits_fn, x0, target, attention_mask, document_ids, mc_samples, generators, max_rows):
        return conditional_ar_nll(lambda x, m, d: logits_fn(x, m, d, None), x0, target, attention_mask, document_ids)

    def greedy_match(self, logits_fn, x0, target, attention_mask, document_ids):
        pred = logits_fn(x0, attention_mask, document_ids, None)[:, :-1, : self.vocab_size].argmax(-1)
        return ((pred == x0[:, 1:]) | ~target[:, 1:]).all(-1)


@dataclass(frozen=True)
class BlockDiffusion(Objective):
    """Block diffusion (BD3-LM; SDAR, Fast-dLLM v2 and Megatron-Bridge's variants): the model runs on
    `[x_t | x_0]` under `blocks.two_stream_keep` (a noisy block sees itself and the earlier clean blocks), noise
    is drawn per block (t_j ~ U(eps, 1), stratified over every block of the global batch with antithetic_t), and
    the masked-diffusion loss is taken on the noisy half (1/t, L/#masked or no weighting). With
    `ar_loss_weight` (token-causal clean half only: block-causal would let a token see its successor), the clean
    half adds the next-token loss, so one checkpoint decodes both ways (Megatron-Bridge: 0.3 / 1.0). Validation
    and evaluation report the block ELBO: the discrete masked ELBO of each block given the earlier clean blocks.
    Decoding (the HF export's `block_generate`) goes block by block with an exact KV cache of finished blocks.

    Recipe variants: `block_shift` (Fast-dLLM v2, Dream-style): logit i predicts token i + 1, so an AR
    checkpoint's head keeps its meaning; inside block j the noisy logit before a token predicts it, and the first
    token of block j is predicted by the clean logit of the last token of block j - 1 (it sees exactly the
    earlier clean blocks, never the token itself); token 0 is context, never masked or scored.
    `complementary_masks` (Fast-dLLM v2, LLaDA 2.0): training doubles each sequence, once with its mask m and
    once with the complement of m among the noisable tokens (weight 1/(1-t); with exact counts the pair's count is
    uniform on {0..n} and each side weighs (n + 1)/its count, so the pair averages to the block ELBO), so every
    noisy-block token is supervised exactly once across the pair; the loss averages both. Validation
    and the bound are unchanged by it (one mask: the block ELBO)."""

    eps: float = _eps()
    loss_weighting: Literal["inverse_t", "masked_fraction", "none"] = _loss_weighting()
    normalize_by: Literal["all_tokens", "masked_tokens"] = _normalize_by()
    block_size: int = setting(4, "Tokens per block (BD3-LM 4-16, SDAR 4, Fast-dLLM v2 32).", identity=IF_SET, ge=1)
    clean_attention: Literal["block_causal", "token_causal"] = setting(
        "block_causal",
        "Attention within the clean half. block_causal (BD3-LM): a clean token sees its own block and the earlier "
        "ones; token_causal (Megatron-Bridge's sbd_block_diff): the clean half is causal, an AR model (needed by "
        "ar_loss_weight).",
        identity=IF_SET,
    )
    ar_loss_weight: float = setting(
        0.0,
        "Weight of the next-token loss on the clean half, added to the diffusion loss (Megatron-Bridge's 0.3 DLM + "
        "1.0 AR is about 3.3 here, up to scale); needs clean_attention=token_causal.",
        identity=IF_SET,
        ge=0.0,
    )
    block_shift: bool = setting(
        False,
        "Shifted prediction (Fast-dLLM v2, Dream-style): logit i predicts token i + 1, so an AR checkpoint's head "
        "keeps its meaning; a block's first token is predicted by the clean logit of the token before it. Token 0 "
        "is context (never masked or scored); the export decodes the same way.",
        identity=IF_SET,
    )
    complementary_masks: bool = setting(
        False,
        "Train each sequence twice, with its mask and with the mask's complement (Fast-dLLM v2, LLaDA 2.0: every "
        "noisy-block token supervised once per pair; a doubled micro-batch, twice the FLOPs); the loss averages "
        "both. Validation keeps the block ELBO.",
        identity=IF_SET,
    )

    name = "difflm-block"
    uses_t = False  # one t per block: no per-sequence time conditioning
    unmasks = True
    two_stream = True

    def __post_init__(self):
        if self.ar_loss_weight and self.clean_attention != "token_causal":
            raise ValueError(
                "diffusion.ar_loss_weight needs diffusion.clean_attention=token_causal: under block_causal a clean "
                "token sees the next token of its block, so a next-token loss would be trivial"
            )
        if self.ar_loss_weight and self.normalize_by != "all_tokens":
            raise ValueError(
                "diffusion.ar_loss_weight shares the diffusion loss's token count: normalize_by=all_tokens"
            )

    @classmethod
    def check_model(cls, backend, time_embedding, attention_anneal_steps):
        super().check_model(backend, time_embedding, attention_anneal_steps)
        if time_embedding:
            raise ValueError(
                "difflm-block draws one t per block: diffusion.time_embedding (one t per sequence) does not apply"
            )
        if backend == "te":
            raise ValueError(
                "difflm-block needs model.backend=torch (FlexAttention block mask on GPUs) or local (dense mask): "
                "Transformer Engine takes causal / padding masks and THD sequences, not the two-stream block mask"
            )

    @property
    def token_causal(self) -> bool:
        return self.clean_attention == "token_causal"

    def model_tokens(self, seq_len):
        return 2 * seq_len

    def attention_pairs(self, seq_len):
        return float(attention_pairs(seq_len, self.block_size, self.token_causal))

    def rows_per_sequence(self, evaluation):
        return 2 if self.complementary_masks and not evaluation else 1

    def keep(self, length: int, document_ids=None, real=None) -> torch.Tensor:
        """[b or 1, 1, 2L, 2L] bool, True = may attend: the two-stream rule of this objective's settings."""
        return two_stream_keep(length, self.block_size, self.token_causal, document_ids, real)

    # ---- where a token's logit lives ------------------------------------------------------------------------
    def _opens_block(self, length: int, device=None) -> torch.Tensor:
        """[L] bool: token i starts a block (with the shift its logit is the clean one of token i - 1)."""
        return torch.arange(length, device=device) % self.block_size == 0

    def align_logits(self, logits):
        """A one-stream forward of the decoding layout (`blocks.decode_keep`): with the shift, token i's logit is
        that of i - 1, which is the clean one before a block's first token, the noisy one inside it."""
        return torch.cat([logits[:, :1], logits[:, :-1]], dim=1) if self.block_shift else logits

    def align_two_stream(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [b, L, V] of the tokens, from those of `[x_t | x_0]` [b, 2L, V]: the noisy half, or with the
        shift the logit of token i - 1 (clean where token i opens a block). Token 0 of a shifted model has no
        logit of its own (callers never mask or score it)."""
        length = logits.shape[1] // 2
        noisy, clean = logits[:, :length], logits[:, length:]
        if not self.block_shift:
            return noisy
        opens = self._opens_block(length, logits.device)[None, 1:, None]
        return torch.cat([noisy[:, :1], torch.where(opens, clean[:, :-1], noisy[:, :-1])], dim=1)

    def _on_logit_rows(self, per_token: torch.Tensor) -> torch.Tensor:
        """[b, L] values of the tokens placed [b, 2L] on the logits that predict them (`align_two_stream`'s
        inverse): the per-token cross-entropy megatron returns is taken where the token is predicted."""
        zeros = torch.zeros_like(per_token)
        if not self.block_shift:
            return torch.cat([per_token, zeros], dim=1)
        nxt = torch.cat([per_token[:, 1:], zeros[:, :1]], dim=1)  # at i: the value of token i + 1
        opens = (torch.arange(per_token.shape[1], device=per_token.device) + 1) % self.block_size == 0  # token i + 1
        return torch.cat([torch.where(opens, zeros, nxt), torch.where(opens, nxt, zeros)], dim=1)

    # ---- training and validation ----------------------------------------------------------------------------
    def _noisable(self, valid: torch.Tensor) -> torch.Tensor:
        """Tokens noise may mask: every data token, but token 0 with the shift (no logit predicts it)."""
        if not self.block_shift:
            return valid
        noisable = valid.clone()
        noisable[:, 0] = False
        return noisable

    def _row_noise(self, ok, pos, generator_for, batch_size, antithetic, evaluation):
        """(masked [L], weight [L], complement weight [L]) of one sequence: t per block, stratified over every
        block of the global batch (block j of sequence pos takes bin j * batch + pos)."""
        length, size = ok.shape[0], self.block_size
        nb = -(-length // size)
        g = generator_for(pos)
        index = torch.arange(nb) * batch_size + pos
        t = stratified_t(torch.rand(nb, generator=g), index, batch_size * nb, self.eps, antithetic or evaluation)
        if self.rows_per_sequence(evaluation) == 2 and self.loss_weighting == "masked_fraction":
            # the pair: count k uniform on {0..n_j} and the complement's n_j - k alike, each side weighted
            # (n_j + 1) / its count, so the pair's expectation is twice the block ELBO (whose count is uniform
            # on {1..n_j} with weight n_j / count), the fully masked block included
            n = block_counts(ok[None], size)[0]
            counts = torch.minimum((t * (n + 1)).ceil() - 1, n).clamp(min=0).long()
            masked = mask_per_block(ok[None], counts[None], size, g)[0]
            weight, complement = (n + 1) / counts.clamp(min=1), (n + 1) / (n - counts).clamp(min=1)
        elif evaluation or self.loss_weighting == "masked_fraction":  # exactly ceil(t n_j) masks: weight n_j / count
            n = block_counts(ok[None], size)[0]
            counts = torch.minimum((t * n).ceil().clamp(min=1), n.clamp(min=1)).long() * (n > 0)
            masked = mask_per_block(ok[None], counts[None], size, g)[0]
            weight, complement = n / counts.clamp(min=1), n / (n - counts).clamp(min=1)
        else:  # each token at its block's rate, weight 1/t (the complement's rate is 1 - t)
            masked = (torch.rand(length, generator=g) < t.repeat_interleave(size)[:length]) & ok
            weight, complement = 1.0 / t, 1.0 / (1.0 - t).clamp(min=self.eps)
        if self.loss_weighting == "none" and not evaluation:
            weight, complement = torch.ones_like(weight), torch.ones_like(complement)
        per_token = [w.float().repeat_interleave(size)[:length] for w in (weight, complement)]
        return masked, *per_token

    def prepare(
        self, tokens, labels, label_ok, positions, generator_for, batch_size, antithetic, evaluation, response=None
    ):
        valid = self._noisable(_data_positions(label_ok, response))  # blocks keep their grid; a prompt stays clean
        rows = [
            self._row_noise(ok, pos, generator_for, batch_size, antithetic, evaluation)
            for ok, pos in zip(valid, positions)
        ]
        masked, weight, complement = (torch.stack(x).to(tokens.device) for x in zip(*rows))
        label_ok = label_ok.bool()
        if self.rows_per_sequence(evaluation) == 2:  # the pair: m, then the complement of m among the noisable
            masked, weight = torch.cat([masked, valid & ~masked]), torch.cat([weight, complement])
            tokens, labels, valid, label_ok = (torch.cat([x, x]) for x in (tokens, labels, valid, label_ok))
        xt = torch.where(masked, torch.full_like(tokens, self.mask_id), tokens)
        scored = masked & valid
        # noisy half: the token there, or with the shift the next one (labels); clean half: the next token
        noisy_targets = labels if self.block_shift else tokens
        return {
            "inputs": torch.cat([xt, tokens], dim=1),  # [rows, 2L]: noisy half, clean half
            "targets": torch.cat([noisy_targets, labels], dim=1),
            "scored": scored,
            "valid": valid,
            "ar_valid": label_ok,
            "weight": weight,
            "loss_weight": self._on_logit_rows(scored * weight),  # [rows, 2L]: on the logits predicting them
            "t": None,
        }

    def loss_terms(self, output, prepared, evaluation):
        output = output.float()
        scored, valid = prepared["scored"], prepared["valid"]
        total = (output * prepared["loss_weight"]).sum()
        by_masked = self.normalize_by == "masked_tokens" and not evaluation
        count = (scored if by_masked else valid).sum()  # complementary pairs: both rows counted, so averaged
        if self.ar_loss_weight and not evaluation:  # per token of the same count (full windows: the same tokens)
            length = valid.shape[1]
            total = total + self.ar_loss_weight * (output[:, length:] * prepared["ar_valid"]).sum()
        return total.to(torch.float32), count.to(torch.int)

    def scored_positions(self, valid, prefix_len=0):
        return super().scored_positions(valid, max(prefix_len, 1) if self.block_shift else prefix_len)

    def nll_per_token(self, logits_fn, x0, scored, t_samples, generator):
        total = block_elbo_terms(
            lambda xt, clean, rows: logits_fn(xt, None, clean=clean),
            x0,
            scored.bool(),
            self.mask_id,
            self.block_size,
            t_samples,
            generator,
            max_rows=max(len(x0), 1),  # one call per draw on the caller's rows (its padding mask fits them)
        )
        n = scored.sum(-1).clamp(min=1).to(total.device)
        return _nan_if_empty((total / n).float(), scored)

    def conditional_nll(self, logits_fn, x0, target, attention_mask, document_ids, mc_samples, generators, max_rows):
        if self.block_shift and target[:, 0].any():
            raise ValueError("a shifted difflm-block model cannot score token 0: give it at least one context token")
        gens = generators if isinstance(generators, (list, tuple)) else [generators] * len(x0)
        out = []
        for i, g in enumerate(gens):  # one row at a time: each row's draws come from its own generator
            m = None if attention_mask is None else attention_mask[i : i + 1]
            d = None if document_ids is None else document_ids[i : i + 1]

            def row_logits(xt, clean, rows, m=m, d=d):
                pick = torch.zeros_like(rows)  # every row here is a copy of row i
                return logits_fn(xt, None if m is None else m[pick], None if d is None else d[pick], None, clean=clean)

            out.append(
                block_elbo_terms(
                    row_logits,
                    x0[i : i + 1],
                    target[i : i + 1].bool(),
                    self.mask_id,
                    self.block_size,
                    mc_samples,
                    g,
                    max_rows,
                )
            )
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)

    def greedy_match(self, logits_fn, x0, target, attention_mask, document_ids):
        return block_greedy_match(
            lambda x, clean: logits_fn(x, attention_mask, document_ids, None, clean=clean),
            x0,
            target,
            self.mask_id,
            self.block_size,
            self.vocab_size,
        )


def _nan_if_empty(per_token: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """A row with no scored token has no per-token bound: NaN, rather than a number for a position it never saw."""
    empty = ~scored.bool().any(-1).to(per_token.device)
    return torch.where(empty, torch.full_like(per_token, math.nan), per_token)


MODES: dict[str, type[Objective]] = {
    cls.name: cls for cls in (MaskedDiffusion, ShiftedMaskedDiffusion, UniformDiffusion, Autoregressive, BlockDiffusion)
}


def build_objective(settings, tokens: dict | None = None) -> Objective:
    """The objective of `settings.model_running_mode` (the config's `diffusion` section, or any object with the
    mode's settings as attributes) with the tokenizer's ids `tokens`: the one reading of a config's mode. A process
    builds it once (trainer start, export) and passes the object on."""
    cls = objective_class(settings.model_running_mode)
    return cls(**(tokens or {}), **{name: getattr(settings, name) for name in cls.settings()})


def objective_from_dict(entry: dict, tokens: dict | None = None) -> Objective:
    """The objective an export recorded (`Objective.to_dict`), with the tokenizer's ids `tokens`; a setting it does
    not record keeps its default (an export older than a setting computed with its default)."""
    cls = objective_class(entry["mode"])
    known = set(cls.settings())
    return cls(**(tokens or {}), **{k: v for k, v in entry.items() if k in known})


def objective_class(mode: str) -> type[Objective]:
    """The class of `mode` (its facts are class attributes: no settings needed to ask them)."""
    try:
        return MODES[mode]
    except KeyError:
        raise ValueError(f"unknown model_running_mode {mode!r}: one of {sorted(MODES)}") from None
