"""Text in, scores and samples out: the one scorer behind `difflm eval`, the pipeline's tasks and lm-eval.

`Scorer` wraps an export (any mode) and its tokenizer:
- `loglikelihood(pairs)`: log p(continuation | context) and whether greedy decoding reproduces it (None for a
  mode with no greedy order: uniform noise); exact for ar, the Monte-Carlo conditional ELBO for diffusion modes
  (a lower bound on log p);
- `loglikelihood_rolling(texts)`: the log-likelihood of whole documents, scored in windows with context;
- `generate(prompts, ...)`: samples, every one recording its full sampler settings.

Tokenisation follows lm-eval: context and continuation are encoded together and split where the context's
tokens end (a leading space belongs to the continuation); an empty context becomes EOS, the start of a
document in training. Each request draws its noise from a generator seeded by (seed, its tokens), so a score,
and a sampled generation, does not depend on the requests batched with it or on their order.
"""

from __future__ import annotations

import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from difflm.models.diffusion import MaskedSampler, rolling_windows
from difflm.models.evaluation.efficiency import ModelCalls


def request_generator(seed: int, *token_lists: list[int]) -> torch.Generator:
    """A CPU generator seeded by (seed, the request's tokens): the helpers draw their noise on the CPU, so a
    request scores the same on every device."""
    data = b"|".join(torch.tensor(t, dtype=torch.int64, device="cpu").numpy().tobytes() for t in token_lists)
    return torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(data))


@dataclass
class Scorer:
    model: object
    tokenizer: object
    mc_samples: int = 32  # Monte-Carlo draws of the conditional ELBO per request (diffusion modes)
    batch_size: int = 8  # requests per model call (each expands to mc_samples rows for diffusion)
    seed: int = 0
    max_length: int | None = None  # default: the model's max_position_embeddings (its training seq_length)
    greedy: bool = True  # compute is_greedy (costs one model call per continuation token for diffusion)
    progress: Callable[[int], None] | None = None  # called with the requests each model call scored

    def __post_init__(self):
        self.max_length = self.max_length or int(self.model.config.max_position_embeddings)
        self.eos = int(self.model.config.eos_token_id)
        self.pad = int(self.model.config.pad_token_id if self.model.config.pad_token_id is not None else self.eos)

    @property
    def mode(self) -> str:
        return self.model.config.model_running_mode

    @property
    def objective(self):
        return self.model.objective

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def split_tokens(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as lm-eval splits them."""
        n_space = len(context) - len(context.rstrip())
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        whole = self.encode(context + continuation)
        ctx = self.encode(context)
        if whole[: len(ctx)] != ctx:  # the tokenizer merged across the boundary: encode apart
            return ctx or [self.eos], self.encode(continuation)
        return ctx or [self.eos], whole[len(ctx) :]

    # ---- log-likelihood ------------------------------------------------------------------------------
    def loglikelihood(self, pairs: list[tuple[str, str]], progress=None) -> list[tuple[float, bool]]:
        return self.loglikelihood_tokens([self.split_tokens(c, x) for c, x in pairs], progress)

    def loglikelihood_tokens(
        self, requests: list[tuple[list[int], list[int]]], progress=None
    ) -> list[tuple[float, bool | None]]:
        """[(log p(cont | ctx), is_greedy)] for (context ids, continuation ids) requests, longest first in
        batches. A request longer than max_length keeps its newest context tokens; a continuation that does
        not fit at all is scored in windows (`rolling_windows`), each given the tokens before it: the chain
        rule, exact for ar, a sum of bounds for diffusion."""
        parts, owner = [], []
        for k, (ctx, cont) in enumerate(requests):
            if not cont:
                raise ValueError("empty continuation: nothing to score")
            if len(cont) < self.max_length:
                parts.append((ctx[-(self.max_length - len(cont)) :], cont))
                owner.append(k)
                continue
            ids = ctx + cont
            for c, a, z in rolling_windows(len(ids), self.max_length, self.max_length // 2, first=len(ctx)):
                parts.append((ids[c:a], ids[a:z]))
                owner.append(k)
        progress = progress or self.progress
        if hasattr(progress, "expect"):  # a Progress learns the total here (lm-eval's bar knows its own)
            progress.expect(len(parts))
        order = sorted(range(len(parts)), key=lambda i: -(len(parts[i][0]) + len(parts[i][1])))
        defined = self.objective.has_greedy or not self.greedy  # uniform noise has no greedy order: n/a (None)
        totals, greedy = [0.0] * len(requests), [True if defined else None] * len(requests)
        for a in range(0, len(order), self.batch_size):
            idx = order[a : a + self.batch_size]
            nll, hit = self._score_rows([parts[i] for i in idx])
            for j, i in enumerate(idx):
                totals[owner[i]] -= float(nll[j])
                if defined:
                    greedy[owner[i]] &= bool(hit[j])
            if progress:
                progress(len(idx))
        return list(zip(totals, greedy))

    def _score_rows(self, rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(nll [n], is_greedy [n]) on the CPU of (context, continuation) rows, batched on the model's device
        with right padding (positions stay those of training)."""
        width = max(len(c) + len(x) for c, x in rows)
        pads = [width - len(c) - len(x) for c, x in rows]
        dev = self.device
        ids = torch.tensor([c + x + [self.pad] * k for (c, x), k in zip(rows, pads)], device=dev)
        attn = torch.tensor([[1] * (len(c) + len(x)) + [0] * k for (c, x), k in zip(rows, pads)], device=dev)
        target = torch.tensor(
            [[False] * len(c) + [True] * len(x) + [False] * k for (c, x), k in zip(rows, pads)], device=dev
        )
        gens = [request_generator(self.seed, c, x) for c, x in rows]
        nll = self.model.conditional_nll(ids, target, attn, mc_samples=self.mc_samples, generators=gens)
        if self.greedy and self.objective.has_greedy:
            greedy = self.model.greedy_match(ids, target, attn).cpu()
        else:
            greedy = torch.zeros(len(rows), dtype=torch.bool, device="cpu")
        return nll.cpu(), greedy

    def loglikelihood_rolling(self, texts: list[str], context_len: int | None = None, progress=None) -> list[float]:
        """log p(text) of each whole text (a lower bound for diffusion modes): EOS + its tokens cut into
        windows of max_length, each re-reading `context_len` tokens before it (default max_length // 2)."""
        context_len = self.max_length // 2 if context_len is None else context_len
        requests, owner = [], []
        for k, text in enumerate(texts):
            ids = [self.eos, *self.encode(text)]
            for c, a, z in rolling_windows(len(ids), self.max_length, context_len):
                requests.append((ids[c:a], ids[a:z]))
                owner.append(k)
        saved, self.greedy = self.greedy, False
        try:
            scores = self.loglikelihood_tokens(requests, progress)
        finally:
            self.greedy = saved
        totals = [0.0] * len(texts)
        for k, (ll, _) in zip(owner, scores):
            totals[k] += ll
        return totals

    # ---- generation ----------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int,
        settings: MaskedSampler,
        until: list[str] | None = None,
        prompt_ids: list[list[int]] | None = None,
    ) -> list[dict]:
        """A completion per prompt (batched, left-padded), cut at EOS and at the first `until` string.
        Each record carries the sampler settings, the wall time of its batch (its share: seconds), the time to the
        first model call's end (`ttft_s`), its valid tokens (`tokens`: up to the first EOS) and its batch's model
        calls: `nfe` every forward (counted by a hook: efficiency.py), `model_calls` the sampler's denoising calls.

        Prompt and completion fit in max_length: `max_new_tokens` is capped at max_length - 1 (with a warning) and
        each prompt keeps its newest max_length - max_new_tokens tokens. Each row draws from a generator seeded
        by (seed, its prompt tokens), so a sampled completion does not depend on the prompts batched with it.
        `prompt_ids`: the prompts' tokens as given (an instruction's chat template, special tokens included, which
        decoding then encoding the text would not give back); `prompts` then only label the records."""
        if max_new_tokens >= self.max_length:
            warnings.warn(
                f"max_new_tokens={max_new_tokens} does not fit the model's max_length {self.max_length} "
                f"with a prompt: generating {self.max_length - 1} tokens (pass a smaller max_gen_toks)",
                stacklevel=2,
            )
            max_new_tokens = self.max_length - 1
        out = []
        for a in range(0, len(prompts), self.batch_size):
            batch = prompts[a : a + self.batch_size]
            given = prompt_ids[a : a + self.batch_size] if prompt_ids is not None else [self.encode(p) for p in batch]
            encoded = [e[-(self.max_length - max_new_tokens) :] or [self.eos] for e in given]
            width = max(map(len, encoded))
            ids = torch.tensor([[self.pad] * (width - len(e)) + e for e in encoded], device=self.device)
            attn = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=self.device)
            gens = [request_generator(self.seed, e) for e in encoded]  # noise is drawn on the CPU, per row
            stats: dict = {}
            counter = ModelCalls(self.model)
            with counter.counting():
                _sync(self.device)
                t0 = time.perf_counter()
                seq = self.model.generate_continuation(
                    ids, max_new_tokens, settings, gens, attention_mask=attn, forbidden_ids=(self.pad,), stats=stats
                )
                _sync(self.device)
                seconds = time.perf_counter() - t0
            ttft = (counter.first_end - t0) if counter.first_end is not None else None
            for row, prompt in enumerate(batch):
                new = seq[row, width:].tolist()
                tokens = new[: new.index(self.eos)] if self.eos in new else new
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                for stop in until or []:
                    if stop and stop in text:
                        text = text[: text.index(stop)]
                out.append(
                    {
                        "prompt": prompt,
                        "completion": text,
                        "tokens": len(tokens),
                        "model_calls": stats.get("nfe"),
                        "nfe": counter.calls,  # this sample rode every call of its batch
                        "seconds": seconds / len(batch),
                        "batch_seconds": seconds,
                        "batch_size": len(batch),
                        "ttft_s": ttft,
                        "sampler": {
                            **asdict(settings),
                            **stats.get("settings", {}),  # what the model's own decoder adds (block diffusion)
                            "max_new_tokens": max_new_tokens,
                            "mode": self.mode,
                            "seed": self.seed,
                        },
                    }
                )
        return out


def _sync(device: torch.device) -> None:
    """Wait for the GPU's queued work, so that the clock measures it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
