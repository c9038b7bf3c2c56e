"""Plain-torch transformer equal to megatron-core's GPTModel (local spec), for exported checkpoints.

Copied into every Hugging Face export folder with `configuration_difflm.py` and the modules of
`models/diffusion/`, so `AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)` works offline
and gives the megatron model's logits. Layout follows megatron: pre-norm blocks, fused QKV grouped
per query group ([q_1..q_n, k, v] per group), RoPE with rotate-half, gated MLP with [gate; up] rows.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

# In an export folder these read `from .bounds import ...` and so on: `convert.export_code` rewrites the
# `..diffusion.` prefix when it copies this file next to the diffusion modules.
from ..diffusion.arch import ModelArch
from ..diffusion.blocks import DecodeLayout, decode_keep
from ..diffusion.documents import document_attention_mask
from ..diffusion.documents import document_ids as eos_document_ids
from ..diffusion.modes import Objective, objective_from_dict
from ..diffusion.samplers import (
    MaskedSampler,
    block_spans,
    draw_multinomial,
    filter_logits,
    sample_masked_diffusion,
)
from ..diffusion.time_embedding import AdaLNorm, TimeEmbedding
from ..diffusion.uniform import uniform_states
from .configuration_difflm import DiffLMConfig

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class ZeroCenteredNorm(nn.Module):
    """RMSNorm / LayerNorm scaling by (1 + w), w stored zero-centred (Gemma; megatron's zero-centred gamma)."""

    def __init__(self, dim: int, eps: float, rms: bool):
        super().__init__()
        self.shape, self.eps, self.rms = (dim,), eps, rms
        self.weight = nn.Parameter(torch.zeros(dim))
        self.bias = None if rms else nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return F.rms_norm(x, self.shape, self.weight + 1, self.eps)
        return F.layer_norm(x, self.shape, self.weight + 1, self.bias, self.eps)


def _norm(config: DiffLMConfig, arch: ModelArch, dim: int) -> nn.Module:
    rms = arch.normalization == "RMSNorm"
    if arch.norm_offset:
        return ZeroCenteredNorm(dim, config.norm_eps, rms)
    return nn.RMSNorm(dim, eps=config.norm_eps) if rms else nn.LayerNorm(dim, eps=config.norm_eps)


def _rope(seq_len: int, dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # [s, d]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: DiffLMConfig, arch: ModelArch):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_groups = config.num_key_value_heads
        self.head_dim = arch.head_width(config.hidden_size, self.n_heads)
        self.causal = not config.bidirectional
        qkv_out = self.head_dim * (self.n_heads + 2 * self.n_groups)
        self.linear_qkv = nn.Linear(config.hidden_size, qkv_out, bias=arch.qkv_bias)
        self.linear_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = _norm(config, arch, self.head_dim) if arch.qk_norm else None
        self.k_norm = _norm(config, arch, self.head_dim) if arch.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: dict | None = None,
        update_cache: bool = True,
    ):
        b, s, _ = x.shape
        per_group = self.n_heads // self.n_groups
        qkv = self.linear_qkv(x).view(b, s, self.n_groups, (per_group + 2) * self.head_dim)
        q, k, v = qkv.split([per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        q = q.reshape(b, s, self.n_heads, self.head_dim)  # [b, s, h, d]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        if cache is not None:  # decoding: keys and values of the earlier positions (after RoPE)
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
            if update_cache:  # block decoding reads the cache for a noisy block without keeping it
                cache["k"], cache["v"] = k, v
        k = k.repeat_interleave(per_group, dim=2)
        v = v.repeat_interleave(per_group, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
        # SDPA's is_causal aligns the query block top-left: right only when queries and keys start together
        causal = self.causal and mask is None and q.shape[2] == k.shape[2]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, config: DiffLMConfig, arch: ModelArch):
        super().__init__()
        self.gated = arch.gated_mlp
        fc1_out = config.intermediate_size * (2 if self.gated else 1)
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_out, bias=False)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[arch.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.linear_fc2(h)


class Block(nn.Module):
    def __init__(self, config: DiffLMConfig, arch: ModelArch):
        super().__init__()
        self.adaln = _uses_adaln(config)
        norm = (
            (lambda: AdaLNorm(config.hidden_size, config.norm_eps, arch.normalization))
            if self.adaln
            else (lambda: _norm(config, arch, config.hidden_size))
        )
        self.input_layernorm = norm()
        self.self_attention = Attention(config, arch)
        self.pre_mlp_layernorm = norm()
        self.mlp = MLP(config, arch)

    def forward(self, x, cos, sin, mask, t=None, cache=None, update_cache=True):
        h = self.input_layernorm(x, t) if self.adaln else self.input_layernorm(x)
        x = x + self.self_attention(h, cos, sin, mask, cache, update_cache)
        h = self.pre_mlp_layernorm(x, t) if self.adaln else self.pre_mlp_layernorm(x)
        return x + self.mlp(h)


def _with_padding(keep: torch.Tensor, attention_mask: torch.Tensor | None, offset: int) -> torch.Tensor:
    """`keep` [b or 1, 1, s, offset + s] without padding keys; every query keeps its own key (no empty row)."""
    if attention_mask is None:
        return keep
    s = keep.shape[-2]
    own = torch.zeros(s, offset + s, dtype=torch.bool, device=keep.device)
    own[:, offset:] = torch.eye(s, dtype=torch.bool, device=keep.device)
    return keep & (attention_mask.bool()[:, None, None, :] | own)


def _uses_adaln(config: DiffLMConfig) -> bool:
    return bool(config.time_embedding) and getattr(config, "time_conditioning", "input") == "adaln"


def export_objective(config: DiffLMConfig) -> Objective:
    """The objective an export was trained with: its `objective` entry, or in an export written before that entry
    the mode and the settings it kept as fields of their own (eps = 1e-3 before `diffusion_eps` was recorded)."""
    return objective_from_dict(*_objective_entry(config))


def _objective_entry(config: DiffLMConfig) -> tuple[dict, dict]:
    """(the objective's entry, the tokenizer's ids) of `config`."""
    entry = getattr(config, "objective", None) or {
        "mode": config.model_running_mode,
        "eps": getattr(config, "diffusion_eps", 1e-3),
        **{k: getattr(config, k) for k in ("block_size", "clean_attention", "block_shift") if getattr(config, k, None)},
    }
    tokens = {
        "mask_id": config.mask_token_id,
        "vocab_size": getattr(config, "real_vocab_size", None) or config.vocab_size,
        "pad_id": config.pad_token_id,
        "eos_id": config.eos_token_id,
    }
    return entry, tokens


class PrefixCachedLogits:
    """The logits function of a full-sequence masked model decoding with Fast-dLLM's prefix cache (approximate,
    `MaskedSampler.prefix_cache`). At the first step of each block (a new earliest masked position's block) the
    whole sequence is run, as without the cache, and the keys and values of the positions before the block are
    kept; the block's other steps run the block and what follows it against them, so a step costs the suffix's
    tokens, not the sequence's. Under bidirectional attention the prefix's keys would change as the block is
    unmasked: only the first step of each block is exact. `positions` counts the positions run through the model
    (its FLOPs scale with them)."""

    def __init__(self, model, prompt_len: int, length: int, settings: MaskedSampler, mask, docs):
        self.model, self.mask, self.docs = model, mask, docs
        self.starts = [prompt_len + a for a, _ in block_spans(length, settings.block_length)]
        self.prompt_len, self.start, self.cache, self.last, self.positions = prompt_len, None, None, None, 0

    def _block_start(self, x: torch.Tensor) -> int:
        """The start of the block the sampler is in: the block of the earliest masked generated position."""
        masked = (x[:, self.prompt_len :] == self.model.config.mask_token_id).any(0).nonzero()
        first = self.prompt_len + int(masked[0]) if len(masked) else self.starts[-1]
        return max(a for a in self.starts if a <= first)

    def _time(self, x: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor | None:
        """t of the whole sequence (a time-conditioned model would otherwise read it off the suffix alone)."""
        if t is None and self.model.config.time_embedding:
            return self.model.objective.default_t(x, self.mask)
        return t

    def __call__(self, x: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
        start, t = self._block_start(x), self._time(x, t)
        self.positions += x.shape[1] if start != self.start or not start else x.shape[1] - start
        if start != self.start or not start:  # a new block (or nothing to cache): the full forward, once
            self.cache = [{} for _ in self.model.layers]
            out = self.model(x, attention_mask=self.mask, t=t, document_ids=self.docs, past_key_values=self.cache)
            for layer in self.cache:  # keep the prefix only: the block and what follows change at every step
                layer["k"], layer["v"] = layer["k"][:, :start], layer["v"][:, :start]
            self.start, self.last = start, out.logits[:, start - 1 : start]
            return self.model.objective.align_logits(out.logits)
        keep = torch.ones(1, 1, x.shape[1] - start, x.shape[1], dtype=torch.bool, device=x.device)
        if self.docs is not None:  # the packed documents of training, for the new queries against every key
            keep = (self.docs[:, start:, None] == self.docs[:, None, :])[:, None]
        out = self.model(
            x[:, start:],
            attention_mask=self.mask,
            t=t,
            past_key_values=self.cache,
            attention_keep=keep,
            update_cache=False,
        ).logits
        # the positions before the block are never masked: the sampler does not read their logits; the one
        # before the block is kept for a shifted model, whose logit i is that of position i - 1
        before = out.new_zeros(x.shape[0], start, out.shape[-1])
        before[:, -1:] = self.last
        return self.model.objective.align_logits(torch.cat([before, out], dim=1))


class _BlockRun:
    """The model calls of block decoding on a `DecodeLayout` canvas: the finished (clean) columns into an exact
    KV cache, run once (with `use_cache`), and the logits of the block being decoded."""

    def __init__(self, model: DiffLMForMaskedLM, rule, keys: torch.Tensor, use_cache: bool):
        self.model, self.rule, self.keys = model, rule, keys  # keys [b, width]: False at padding
        self.cache = [{} for _ in model.layers] if use_cache else None
        self.cached = 0  # canvas columns whose keys and values are in the cache
        self.last: torch.Tensor | None = None  # the clean logit of the column before the current block
        self.nfe = 0

    def prefix(self, x: torch.Tensor, end: int) -> None:
        """Columns [cached, end) of the canvas `x`, finished, into the cache as clean tokens."""
        if self.cache is None or end <= self.cached:
            return
        a = self.cached
        keep = self.rule(end, end - a, end)
        out = self.model(
            x[:, a:end], attention_mask=self.keys[:, :end], past_key_values=self.cache, attention_keep=keep
        )
        self.last, self.cached, self.nfe = out.logits[:, -1:], end, self.nfe + 1

    def logits_fn(self, start: int, end: int):
        """The sampler's logits function while columns [start, end) are the noisy block: logits [b, end, V]
        aligned with the tokens they predict (the sampler reads [start:])."""
        model, keys, objective = self.model, self.keys[:, :end], self.model.objective
        if self.cache is None:

            def uncached(seq: torch.Tensor) -> torch.Tensor:
                keep = self.rule(end, end, start)
                return objective.align_logits(model(seq, attention_mask=keys, attention_keep=keep).logits)

            return uncached
        cache, last = self.cache, self.last

        def cached(seq: torch.Tensor) -> torch.Tensor:
            keep = self.rule(end, end - start, start)
            out = model(
                seq[:, start:], attention_mask=keys, past_key_values=cache, attention_keep=keep, update_cache=False
            )
            out = out.logits
            if objective.block_shift:  # token i's logit is that of token i - 1: the clean one first
                out = torch.cat([out[:, :1] if last is None else last, out[:, :-1]], dim=1)
            return torch.cat([out.new_zeros(len(out), start, out.shape[-1]), out], dim=1)

        return cached


class DiffLMForMaskedLM(PreTrainedModel):
    """Logits for every position of the input; a masked-diffusion (or causal) LM per `config`."""

    config_class = DiffLMConfig
    base_model_prefix = "difflm"

    def __init__(self, config: DiffLMConfig):
        super().__init__(config)
        self.arch = arch = ModelArch.from_hf_config(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.time_embedding = (
            TimeEmbedding(config.hidden_size) if config.time_embedding and not _uses_adaln(config) else None
        )
        self.layers = nn.ModuleList(Block(config, arch) for _ in range(config.num_hidden_layers))
        self.final_layernorm = _norm(config, arch, config.hidden_size)
        # Tied: logits reuse the embedding matrix, so there is no lm_head parameter to keep in sync.
        self.output_layer = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        t: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        past_key_values: list[dict] | None = None,
        clean_ids: torch.Tensor | None = None,
        attention_keep: torch.Tensor | None = None,
        update_cache: bool = True,
        **_,
    ) -> MaskedLMOutput:
        """Logits [b, s, v]. `t` [b] is the noise level for time-conditioned models: required in uniform
        mode (its inputs do not reveal t); masked modes default to the fraction of mask tokens among the
        non-padding positions (the quantity t is the expectation of in training). `document_ids` [b, s]
        restricts attention to each packed document, as in training. `past_key_values` (ar only): one dict per
        layer, filled in place, holding the earlier positions' keys and values (`ar_generate` uses it); then
        `attention_mask` covers the earlier and the new positions.

        Block diffusion: `clean_ids` [b, L] runs the two-stream forward on [input_ids | clean_ids] (RoPE positions
        0..L-1 in both halves, the block mask; logits [b, 2L, v]); `attention_keep` [b or 1, 1, s, offset + s]
        (True = may attend) replaces the direction of attention (block decoding, `blocks.decode_keep`), and
        `update_cache=False` reads the cache without appending the new positions to it."""
        if clean_ids is not None:
            return self._two_stream(input_ids, clean_ids, attention_mask, document_ids)
        b, s = input_ids.shape
        offset = past_key_values[0]["k"].shape[1] if past_key_values and "k" in past_key_values[0] else 0
        x = self._embed(input_ids)
        if self.config.time_embedding:
            t = (self._default_t(input_ids, attention_mask) if t is None else t).to(x.device)
        if self.time_embedding is not None:
            x = x + self.time_embedding(t)[:, None].to(x.dtype)
        cos, sin = _rope(offset + s, self._head_dim, self.config.rope_theta, x.device)
        cos, sin = cos[offset:], sin[offset:]
        # computed in fp32, applied in the activation dtype as megatron's local RoPE does (bit-identical in fp32);
        # fp32 tables in a bf16 model would promote q and k but not v, and SDPA refuses mixed dtypes
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        mask = None
        if attention_keep is not None:
            mask = _with_padding(attention_keep, attention_mask, offset)
        elif attention_mask is not None:  # [b, s] 1 = real token: keys that are padding get no attention
            mask = attention_mask[:, None, None, :].bool()
            if not self.config.bidirectional:  # query i sits at position offset + i of the keys
                mask = mask & torch.ones(s, offset + s, dtype=torch.bool, device=x.device).tril(offset)
        if document_ids is not None:  # True = may attend (SDPA's convention)
            allowed = ~document_attention_mask(document_ids, causal=not self.config.bidirectional)
            mask = allowed if mask is None else mask & allowed
        caches = past_key_values if past_key_values is not None else [None] * len(self.layers)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cos, sin, mask, t, cache, update_cache)
        return MaskedLMOutput(logits=self._head(x))

    @property
    def _head_dim(self) -> int:
        return self.arch.head_width(self.config.hidden_size, self.config.num_attention_heads)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        scale = self.arch.embedding_multiplier(self.config.hidden_size)
        return x if scale is None else x * scale

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        x = self.final_layernorm(x)
        weight = self.embed_tokens.weight if self.output_layer is None else self.output_layer.weight
        return F.linear(x, weight)

    def _two_stream(self, xt, x0, attention_mask, document_ids) -> MaskedLMOutput:
        """Logits [b, 2L, v] of block diffusion's [x_t | x_0] (training's layout and mask)."""
        length = xt.shape[1]
        x = self._embed(torch.cat([xt, x0], dim=1))
        cos, sin = _rope(length, self._head_dim, self.config.rope_theta, x.device)  # head_dim: Qwen3
        cos, sin = cos.repeat(2, 1).to(x.dtype), sin.repeat(2, 1).to(x.dtype)
        mask = self.objective.keep(length, document_ids, attention_mask).to(x.device)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return MaskedLMOutput(logits=self._head(x))

    # ---- diffusion helpers: the mode's objective (models/diffusion/modes.py), shared with training ------------
    # Any device, any dtype: inputs go to the model's device, logits are scored in fp32, and noise is drawn on
    # the CPU from CPU generators (NOISE_DEVICE), so a seeded bound or sample draws the same on every device.
    @property
    def mode(self) -> str:
        return self.config.model_running_mode

    @property
    def objective(self) -> Objective:
        """The objective of this model's mode: its bound, conditional likelihood, sampler and facts (built once
        from the config, again only if the config's objective entry is replaced)."""
        entry = _objective_entry(self.config)
        if getattr(self, "_objective_entry", None) != entry:
            self._objective, self._objective_entry = objective_from_dict(*entry), entry
        return self._objective

    def _default_t(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return self.objective.default_t(input_ids, attention_mask)

    def _documents(self, tokens: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor | None:
        """Training's document segmentation (from EOS in the clean tokens) when the model was trained with it."""
        if document_ids is None and getattr(self.config, "document_attention", False):
            return eos_document_ids(tokens, self.config.eos_token_id)
        return document_ids

    def _logits(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        t: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        clean: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits aligned with the positions they predict (the objective undoes difflm-shift's shift, so position
        0 of a shifted model has no logit of its own: callers never mask or score it). With `clean` (block
        diffusion): the logits of the tokens from [tokens | clean] (the noisy half, or with the shift the logit of
        the token before, `BlockDiffusion.align_two_stream`)."""
        if clean is not None:
            out = self(tokens, attention_mask=attention_mask, document_ids=document_ids, clean_ids=clean).logits
            return self.objective.align_two_stream(out)
        logits = self(tokens, attention_mask=attention_mask, t=t, document_ids=document_ids).logits
        if self.objective.exact:  # an exact likelihood normalises over the tokens, as training's megatron model
            logits = self._tokens_only(logits)
        return self.objective.align_logits(logits)

    def _tokens_only(self, logits: torch.Tensor) -> torch.Tensor:
        """-inf for the rows no token is (the padding past `real_vocab_size`) and for a mask token the import added:
        an imported `ar` model's NLL is then the source's."""
        out = torch.arange(logits.shape[-1], device=logits.device) >= self.config.real_vocab_size
        if getattr(self.config, "mask_token_added", False):
            out[self.config.mask_token_id] = True
        return logits.masked_fill(out, float("-inf"))

    def uniform_states(self) -> torch.Tensor:
        """Token ids uniform noise draws from (the same function training uses), on the model's device."""
        return uniform_states(
            self.config.real_vocab_size, self.config.mask_token_id, self.config.pad_token_id, self.device
        )

    def _on_device(self, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """The helpers' inputs on the model's device: every tensor they derive then lands there too."""
        return tuple(None if t is None else t.to(self.device) for t in tensors)

    def _require(self, what: str, applies: bool, instead: str) -> None:
        if not applies:
            raise ValueError(f"{what} does not apply to a {self.mode!r} model: {instead}")

    @torch.no_grad()
    def diffusion_generate(
        self,
        prompt_ids: torch.Tensor,
        length: int,
        steps: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        forbidden_ids: tuple[int, ...] = (),
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        settings: MaskedSampler | None = None,
        stats: dict | None = None,
    ):
        """Diffusion generation of `length` tokens after `prompt_ids` [b, p]: iterative unmasking for
        masked modes, the posterior (ancestral) sampler for difflm-noshift-uniform. Prompts of different
        lengths go LEFT-padded with their `attention_mask` (padding is never attended to; RoPE is relative,
        so the shift changes nothing). `settings` (masked modes): blocks, remasking rule, threshold decoding,
        top-k/top-p, guidance, stop at EOS (then `steps` and `temperature` are taken from it). `stats`
        receives the number of model calls. Returns [b, p + length]."""
        self._require(
            "diffusion_generate",
            self.objective.bidirectional,
            "sample an autoregressive model token by token (ar_generate; `generate_continuation` picks)",
        )
        if self.objective.two_stream:
            settings = settings or MaskedSampler(steps=steps, temperature=temperature, stop_at_eos=False)
            return self.block_generate(prompt_ids, length, settings, generator, attention_mask, forbidden_ids, stats)
        prompt_ids, attention_mask, document_ids = self._on_device(prompt_ids, attention_mask, document_ids)
        b, p = prompt_ids.shape
        mask = None
        if attention_mask is not None:
            if p and not attention_mask[:, -1].bool().all():
                raise ValueError("prompts must be LEFT-padded for generation: set tokenizer.padding_side = 'left'")
            mask = torch.cat(
                [attention_mask.bool(), torch.ones(b, length, dtype=torch.bool, device=attention_mask.device)], dim=1
            )
        docs = self._documents(prompt_ids, document_ids) if p else None
        if docs is not None:  # the continuation belongs to the prompt's last document
            docs = torch.cat([docs, docs[:, -1:].expand(b, length)], dim=1)
        settings = settings or MaskedSampler(steps=steps, temperature=temperature, stop_at_eos=False)
        logits_fn = lambda x, t: self._logits(x, mask, t, docs)  # noqa: E731
        if settings.prefix_cache:
            logits_fn = self._prefix_cached(p, length, settings, mask, docs)
        seq = self.objective.sample(logits_fn, prompt_ids, length, settings, generator, forbidden_ids, stats)
        if stats is not None and settings.prefix_cache:
            stats["model_positions"] = logits_fn.positions
        return seq

    def _prefix_cached(self, p: int, length: int, settings: MaskedSampler, mask, docs) -> PrefixCachedLogits:
        self._require("prefix_cache", self.objective.unmasks, "it applies to masked diffusion's unmasking sampler")
        if settings.cfg_scale > 0:
            raise ValueError("prefix_cache with classifier-free guidance: the unconditional pass masks the prompt")
        return PrefixCachedLogits(self, p, length, settings, mask, docs)

    @torch.no_grad()
    def block_generate(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        settings: MaskedSampler,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
        forbidden_ids: tuple[int, ...] = (),
        stats: dict | None = None,
        use_cache: bool | None = None,
    ) -> torch.Tensor:
        """Block diffusion decoding (BD3-LM): the blocks of training, `config.block_size` tokens counted from each
        row's first prompt token (the prompt's last, partial block is the first one decoded, its prompt tokens
        kept; `blocks.DecodeLayout` places a LEFT-padded batch), one at a time. Inside a block the masked
        sampler's rules (`settings`: remasking, threshold, top-k/top-p; `settings.block_length` below the block
        size decodes it in sub-blocks, as Fast-dLLM v2); a block of B positions gets ceil(steps B / new tokens)
        steps (`settings.steps` spread over the new tokens). With the KV cache (`use_cache`, default
        `settings.kv_cache`) every finished block is run once as clean tokens and its keys and values kept: exact,
        since no clean token attends a noisy one (the same tokens as without it, which recomputes the prefix at
        every step). Rows stop at EOS
        (`settings.stop_at_eos`): later blocks are EOS. `stats` gets the model calls and the settings. Returns
        [b, p + max_new_tokens]."""
        objective = self.objective
        prompt_ids, attention_mask = self._on_device(prompt_ids, attention_mask)
        real = torch.ones_like(prompt_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        self._check_block_decoding(prompt_ids, real, settings)
        b, size = len(prompt_ids), objective.block_size
        layout = DecodeLayout.of(real, max_new_tokens, size)
        eos = objective.eos_id
        padding = next(i for i in (objective.pad_id, eos, 0, 1) if i is not None and i != objective.mask_id)
        x = layout.place(prompt_ids, objective.mask_id, padding)  # [b, width]
        keys, generated = layout.keys(), layout.generated()
        rule = self._block_rule(prompt_ids, layout)
        block_steps = max(1, -(-settings.steps * size // max(max_new_tokens, 1)))
        use_cache = settings.kv_cache if use_cache is None else use_cache
        run = _BlockRun(self, rule, keys, use_cache)
        run.prefix(x, layout.first_block * size)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        for start, end in layout.blocks():
            if eos is not None and settings.stop_at_eos:  # finished rows: the rest is EOS, not decoded
                x[:, start:] = torch.where(done[:, None] & generated[:, start:], eos, x[:, start:])
                if done.all():
                    break
            block_stats: dict = {}
            decoded = sample_masked_diffusion(
                run.logits_fn(start, end),
                x[:, :start],
                end - start,
                objective.mask_id,
                block_steps,
                vocab_limit=objective.vocab_size,
                temperature=settings.temperature,
                generator=generator,
                forbidden_ids=forbidden_ids,
                settings=dataclasses.replace(settings, steps=block_steps),
                eos_id=eos,
                stats=block_stats,
                initial=x[:, start:end],
            )
            x = torch.cat([decoded, x[:, end:]], dim=1)
            run.nfe += block_stats["nfe"]
            if eos is not None and settings.stop_at_eos:
                done |= ((x[:, start:end] == eos) & generated[:, start:end]).any(-1)
            if end < x.shape[1]:
                run.prefix(x, end)
        if stats is not None:
            stats["nfe"] = run.nfe
            stats["settings"] = {
                "block_size": size,
                "clean_attention": objective.clean_attention,
                "block_shift": objective.block_shift,
                "kv_cache": use_cache,
                "prefix_cache": False,  # the exact cache above is block decoding's own
            }
        return torch.cat([prompt_ids, layout.continuation(x)], dim=1)

    def _check_block_decoding(self, prompt_ids: torch.Tensor, real: torch.Tensor, settings: MaskedSampler) -> None:
        if self.objective.mask_id is None:
            raise ValueError("config.mask_token_id is not set: this export cannot run the diffusion sampler")
        if settings.cfg_scale > 0:
            raise ValueError("classifier-free guidance is not implemented for block decoding: set cfg_scale=0")
        p = prompt_ids.shape[1]
        if p and not real[:, -1].all():
            raise ValueError("prompts must be LEFT-padded for generation: set tokenizer.padding_side = 'left'")
        if self.objective.block_shift and not p:
            raise ValueError(
                "a shifted difflm-block model needs at least one prompt token (each logit predicts the next)"
            )

    def _block_rule(self, prompt_ids: torch.Tensor, layout: DecodeLayout):
        """(n_keys, n_queries, noisy_from) -> the attention rule of block decoding on the layout's canvas, within
        the prompt's last document when the model was trained with document attention."""
        size, causal = self.objective.block_size, self.objective.token_causal
        docs = self._documents(prompt_ids, None) if prompt_ids.shape[1] else None
        if docs is not None:  # the continuation belongs to the prompt's last document
            docs = layout.place(docs, docs[:, -1], -1)

        def rule(n_keys: int, n_queries: int, noisy_from: int) -> torch.Tensor:
            keep = decode_keep(n_keys, n_queries, noisy_from, size, causal, self.device)
            if docs is None:
                return keep
            d = docs[:, :n_keys]
            return keep & (d[:, n_keys - n_queries :, None] == d[:, None, :])[:, None]

        return rule

    @torch.no_grad()
    def generate_continuation(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        settings: MaskedSampler,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
        forbidden_ids: tuple[int, ...] = (),
        stats: dict | None = None,
    ) -> torch.Tensor:
        """`max_new_tokens` after LEFT-padded prompts with this model's own sampler: token by token with a cache
        for a causal model, the objective's diffusion sampler otherwise. `stats` gets the model calls (`nfe`)."""
        if self.objective.bidirectional:
            return self.diffusion_generate(
                prompt_ids,
                max_new_tokens,
                settings.steps,
                settings.temperature,
                generator,
                forbidden_ids=forbidden_ids,
                attention_mask=attention_mask,
                settings=settings,
                stats=stats,
            )
        seq = self.ar_generate(
            prompt_ids,
            max_new_tokens,
            settings.temperature,
            settings.top_k,
            settings.top_p,
            generator,
            attention_mask=attention_mask,
            stop_at_eos=settings.stop_at_eos,
        )
        if stats is not None:
            stats["nfe"] = seq.shape[1] - prompt_ids.shape[1]
        return seq

    @torch.no_grad()
    def ar_generate(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
        stop_at_eos: bool = True,
    ) -> torch.Tensor:
        """Token-by-token decoding of an `ar` model with a key/value cache: greedy (temperature 0) or sampled
        with top-k/top-p. LEFT-padded prompts with their `attention_mask`. Rows that produced EOS continue
        with EOS; decoding ends when every row has (stop_at_eos). Returns [b, p + n], n <= max_new_tokens."""
        self._require("ar_generate", not self.objective.bidirectional, "use diffusion_generate")
        prompt_ids, attention_mask = self._on_device(prompt_ids, attention_mask)
        b, p = prompt_ids.shape
        if p == 0:
            raise ValueError("ar_generate needs at least one prompt token (e.g. EOS as a start of document)")
        cache = [{} for _ in self.layers]
        mask = None if attention_mask is None else attention_mask.bool()
        ids, step_in = prompt_ids, prompt_ids
        finished = torch.zeros(b, dtype=torch.bool, device=prompt_ids.device)
        eos = self.config.eos_token_id
        for _ in range(max_new_tokens):
            logits = self(step_in, attention_mask=mask, past_key_values=cache).logits[:, -1].float()
            logits = logits[:, : self.config.real_vocab_size]
            if self.config.mask_token_id is not None and self.config.mask_token_id < logits.shape[-1]:
                logits[:, self.config.mask_token_id] = float("-inf")
            if temperature > 0:
                probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), -1)
                nxt = draw_multinomial(probs[:, None], generator).to(ids.device)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            if eos is not None:
                nxt = torch.where(finished[:, None], torch.full_like(nxt, eos), nxt)
                finished |= nxt[:, 0] == eos
            ids, step_in = torch.cat([ids, nxt], dim=1), nxt
            if mask is not None:
                mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.bool, device=mask.device)], dim=1)
            if stop_at_eos and eos is not None and finished.all():
                break
        return ids

    def _row_logits(self, x, m, d, t, clean=None):
        return self._logits(x, m, t, d, clean)

    @torch.no_grad()
    def conditional_nll(
        self,
        input_ids: torch.Tensor,
        target: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        mc_samples: int = 32,
        generators=None,
        max_rows: int = 64,
    ) -> torch.Tensor:
        """-log p(continuation | context) in nats per row [b] (float64): `target` [b, s] marks the continuation,
        the other attended positions are its context. Exact for ar; for masked modes the Monte-Carlo
        conditional ELBO (an upper bound, `mc_samples` draws; pass one seeded generator per row for
        reproducible values); for difflm-noshift-uniform UDLM's bound with `mc_samples` noise levels. A model
        trained with document attention is scored with training's document segmentation."""
        input_ids, target, attention_mask = self._on_device(input_ids, target, attention_mask)
        target = target.bool() & (attention_mask.bool() if attention_mask is not None else True)
        return self.objective.conditional_nll(
            self._row_logits,
            input_ids,
            target,
            attention_mask,
            self._documents(input_ids, None),
            mc_samples,
            generators,
            max_rows,
        )

    @torch.no_grad()
    def greedy_match(
        self, input_ids: torch.Tensor, target: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Would greedy decoding produce the continuation (`target` positions) from the context? [b] bool.
        ar: the argmax at every step; masked modes: greedy low-confidence decoding, one token per step."""
        self._require("greedy_match", self.objective.has_greedy, "uniform-noise models have no greedy order")
        input_ids, target, attention_mask = self._on_device(input_ids, target, attention_mask)
        return self.objective.greedy_match(
            self._row_logits, input_ids, target.bool(), attention_mask, self._documents(input_ids, None)
        )

    @torch.no_grad()
    def elbo_nll(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        t_samples: int = 8,
        generator: torch.Generator | None = None,
        prefix_len: int = 0,
        document_ids: torch.Tensor | None = None,
        eps: float | None = None,
    ):
        """Upper bound of the NLL per scored token (nats) of each sequence [b], for any diffusion mode.

        Padding (attention_mask 0) is neither scored nor attended to; the first `prefix_len` tokens are
        conditioned on (kept clean, not scored): prefix_len=1 scores the same tokens as `ar_nll`. difflm-shift
        always conditions on token 0. `eps` (uniform noise): the smallest noise level, default the trained one.
        A Monte-Carlo estimate: pass a seeded `generator` to make it reproducible. NaN for a row with nothing
        to score."""
        self._require(
            "elbo_nll", not self.objective.exact, "its exact likelihood is model.ar_nll(input_ids, attention_mask)"
        )
        return self.nll_per_token(input_ids, attention_mask, t_samples, generator, prefix_len, document_ids, eps)

    @torch.no_grad()
    def ar_nll(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ):
        """Exact NLL per scored token (nats) of each sequence [b] for an `ar` model: tokens 1.. given their
        prefix (right padding, attention_mask 0, is not scored)."""
        self._require(
            "ar_nll", self.objective.exact, "its likelihood bound is model.elbo_nll(input_ids, attention_mask)"
        )
        return self.nll_per_token(input_ids, attention_mask, document_ids=document_ids)

    @torch.no_grad()
    def nll_per_token(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        t_samples: int = 8,
        generator: torch.Generator | None = None,
        prefix_len: int = 0,
        document_ids: torch.Tensor | None = None,
        eps: float | None = None,
        scored: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The likelihood of this model's mode per scored token [b]: exact for ar (tokens 1..), the ELBO otherwise.
        `scored` [b, s]: only these tokens are scored (instruction data: the response), the others kept clean."""
        input_ids, attention_mask, document_ids = self._on_device(input_ids, attention_mask, document_ids)
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if scored is not None:
            valid = valid & scored.to(valid.device).bool()
        objective = self.objective
        if eps is not None and "eps" in objective.settings():
            objective = dataclasses.replace(objective, eps=eps)
        docs = self._documents(input_ids, document_ids)
        return objective.nll_per_token(
            lambda x, t, clean=None: self._logits(x, attention_mask, t, docs, clean),
            input_ids,
            objective.scored_positions(valid, prefix_len),
            t_samples,
            generator,
        )
