"""Plain-torch transformer equal to megatron-core's GPTModel (local spec), for exported checkpoints.

Copied into every Hugging Face export folder with `configuration_difflm.py` and the modules of
`models/diffusion/`, so `AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)` works offline
and gives the megatron model's logits. Layout follows megatron: pre-norm blocks, fused QKV grouped
per query group ([q_1..q_n, k, v] per group), RoPE with rotate-half, gated MLP with [gate; up] rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from .configuration_difflm import DiffLMConfig
# In an export folder these read `from .bounds import ...` and so on: `convert.export_code` rewrites the
# `..diffusion.` prefix when it copies this file next to the diffusion modules.
from ..diffusion.bounds import elbo_nll_per_token
from ..diffusion.documents import document_attention_mask
from ..diffusion.samplers import sample_masked_diffusion, sample_uniform_diffusion
from ..diffusion.time_embedding import TimeEmbedding


def _norm(config: DiffLMConfig, dim: int) -> nn.Module:
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(dim, eps=config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps)


def _rope(seq_len: int, dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # [s, d]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: DiffLMConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_groups = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.n_heads
        self.causal = not config.bidirectional
        qkv_out = self.head_dim * (self.n_heads + 2 * self.n_groups)
        self.linear_qkv = nn.Linear(config.hidden_size, qkv_out, bias=False)
        self.linear_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = _norm(config, self.head_dim) if config.qk_layernorm else None
        self.k_norm = _norm(config, self.head_dim) if config.qk_layernorm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None):
        b, s, _ = x.shape
        per_group = self.n_heads // self.n_groups
        qkv = self.linear_qkv(x).view(b, s, self.n_groups, (per_group + 2) * self.head_dim)
        q, k, v = qkv.split([per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        q = q.reshape(b, s, self.n_heads, self.head_dim)  # [b, s, h, d]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        k = k.repeat_interleave(per_group, dim=2)
        v = v.repeat_interleave(per_group, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, config: DiffLMConfig):
        super().__init__()
        self.gated = config.gated_mlp
        fc1_out = config.intermediate_size * (2 if self.gated else 1)
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_out, bias=False)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = F.silu if config.hidden_act == "silu" else F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.linear_fc2(h)


class Block(nn.Module):
    def __init__(self, config: DiffLMConfig):
        super().__init__()
        self.input_layernorm = _norm(config, config.hidden_size)
        self.self_attention = Attention(config)
        self.pre_mlp_layernorm = _norm(config, config.hidden_size)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attention(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class DiffLMForMaskedLM(PreTrainedModel):
    """Logits for every position of the input; a masked-diffusion (or causal) LM per `config`."""

    config_class = DiffLMConfig
    base_model_prefix = "difflm"

    def __init__(self, config: DiffLMConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.time_embedding = TimeEmbedding(config.hidden_size) if config.time_embedding else None
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.final_layernorm = _norm(config, config.hidden_size)
        # Tied: logits reuse the embedding matrix, so there is no lm_head parameter to keep in sync.
        self.output_layer = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                t: torch.Tensor | None = None, document_ids: torch.Tensor | None = None, **_) -> MaskedLMOutput:
        """Logits [b, s, v]. `t` [b] is the noise level for time-conditioned models (default: the
        fraction of mask tokens in each row, the quantity t is the expectation of in training).
        `document_ids` [b, s] restricts attention to each packed document, as in training."""
        b, s = input_ids.shape
        x = self.embed_tokens(input_ids)
        if self.time_embedding is not None:
            if t is None:
                t = (input_ids == self.config.mask_token_id).float().mean(-1)
            x = x + self.time_embedding(t.to(x.device))[:, None].to(x.dtype)
        cos, sin = _rope(s, self.config.hidden_size // self.config.num_attention_heads, self.config.rope_theta, x.device)
        mask = None
        if attention_mask is not None:  # [b, s] 1 = real token: keys that are padding get no attention
            mask = attention_mask[:, None, None, :].bool()
            if not self.config.bidirectional:
                mask = mask & torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        if document_ids is not None:  # True = may attend (SDPA's convention)
            allowed = ~document_attention_mask(document_ids, causal=not self.config.bidirectional)
            mask = allowed if mask is None else mask & allowed
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = self.final_layernorm(x)
        weight = self.embed_tokens.weight if self.output_layer is None else self.output_layer.weight
        return MaskedLMOutput(logits=F.linear(x, weight))

    # ---- diffusion helpers: the same pure functions training and evaluation use -----------------
    def _logits(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits aligned with the positions they predict (difflm-shift predicts the next position)."""
        logits = self(tokens, attention_mask=attention_mask).logits
        if self.config.model_running_mode == "difflm-shift":
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits

    def _allowed_ids(self) -> torch.Tensor:
        keep = torch.ones(self.config.real_vocab_size, dtype=torch.bool)
        keep[[i for i in self.config.special_ids if i < self.config.real_vocab_size]] = False
        return keep.nonzero().squeeze(-1)

    @torch.no_grad()
    def diffusion_generate(self, prompt_ids: torch.Tensor, length: int, steps: int, temperature: float = 0.0,
                           generator: torch.Generator | None = None, forbidden_ids: tuple[int, ...] = ()):
        """Diffusion generation of `length` tokens after `prompt_ids` [b, p]: iterative unmasking for
        masked modes, iterative denoising from uniform noise for difflm-noshift-uniform."""
        if self.config.model_running_mode == "difflm-noshift-uniform":
            return sample_uniform_diffusion(self._logits, prompt_ids, length, steps, self._allowed_ids(),
                                            temperature=temperature, generator=generator)
        if self.config.mask_token_id is None:
            raise ValueError("config.mask_token_id is not set: this export cannot run the diffusion sampler")
        return sample_masked_diffusion(
            self._logits, prompt_ids, length, self.config.mask_token_id, steps,
            vocab_limit=self.config.real_vocab_size, temperature=temperature, generator=generator,
            forbidden_ids=forbidden_ids,
        )

    @torch.no_grad()
    def elbo_nll(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, t_samples: int = 8,
                 generator: torch.Generator | None = None):
        """Upper bound of the NLL per token (nats) of each sequence [b]; padding (attention_mask 0) is neither
        scored nor attended to. A Monte-Carlo estimate: pass a seeded `generator` to make it reproducible."""
        valid = attention_mask.bool() if attention_mask is not None else None
        return elbo_nll_per_token(lambda x: self._logits(x, attention_mask), input_ids, self.config.mask_token_id,
                                  t_samples, generator, valid)
