"""The architecture record: the switches of the decoder that both implementations build (megatron-core's spec for
training, `modeling_difflm.py` in every export), in one small frozen value.

Pure Python, and copied into every export folder with the other modules of this package: the export writes the
record whole as the `architecture` entry of config.json and the shipped model reads it back with
`ModelArch.from_hf_config`, which also reads the flat fields of exports written before the record existed.
Norms after attention and MLP (Gemma 2 / 3 "post-norms") have no switch: megatron-core's layer has no slot for
them, so the importer refuses such sources instead.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


@dataclass(frozen=True)
class ModelArch:
    gated_mlp: bool = True  # [gate; up] rows: act(gate) * up (SwiGLU with silu, GeGLU with gelu / gelu_tanh)
    activation: str = "silu"  # one of ACTIVATIONS; gelu_tanh is GELU's tanh approximation (Gemma)
    normalization: str = "RMSNorm"  # or LayerNorm
    norm_offset: int = 0  # norms scale by (norm_offset + w): 1 is Gemma's (1 + w), megatron's zero-centred gamma
    embedding_scale: bool = False  # token embeddings times sqrt(hidden_size) before the first layer (Gemma)
    qk_norm: bool = False  # a norm on every query and key head
    qkv_bias: bool = False  # biases on the fused Q/K/V projection (Qwen2); never on the others
    head_dim: int | None = None  # width of one head; None: hidden_size // num_attention_heads

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: one of {', '.join(ACTIVATIONS)}")
        if self.normalization not in ("RMSNorm", "LayerNorm") or self.norm_offset not in (0, 1):
            raise ValueError(f"norm {self.normalization} with offset {self.norm_offset}: RMSNorm / LayerNorm, 0 / 1")

    @classmethod
    def of(cls, model_cfg: Any) -> ModelArch:
        """The record of a `ModelConfig` (read by attribute: this module imports no config)."""
        gated = model_cfg.gated_mlp
        return cls(
            gated_mlp=gated,
            activation=model_cfg.activation or ("silu" if gated else "gelu"),
            normalization=model_cfg.normalization,
            norm_offset=model_cfg.norm_offset,
            embedding_scale=model_cfg.embedding_scale,
            qk_norm=model_cfg.qk_layernorm,
            qkv_bias=model_cfg.qkv_bias,
            head_dim=model_cfg.kv_channels,
        )

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        """The record of an export's config (a `DiffLMConfig` or its config.json as a dict): its `architecture`
        entry, else the flat fields that exports carried before it (silu or gelu, no offset, no scale)."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        record = get("architecture")
        if record:
            return cls(**record)
        return cls(
            gated_mlp=get("gated_mlp", True),
            activation="silu" if get("hidden_act", "silu") == "silu" else "gelu",
            normalization=get("normalization", "RMSNorm"),
            qk_norm=get("qk_layernorm", False),
            qkv_bias=get("qkv_bias", False),
            head_dim=get("head_dim"),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def model_fields(self) -> dict[str, Any]:
        """The record as `model.*` fields of this project's config (the inverse of `of`)."""
        paired = self.activation == ("silu" if self.gated_mlp else "gelu")  # the config's default (None) for it
        return {
            "gated_mlp": self.gated_mlp,
            "activation": None if paired else self.activation,
            "normalization": self.normalization,
            "norm_offset": self.norm_offset,
            "embedding_scale": self.embedding_scale,
            "qk_layernorm": self.qk_norm,
            "qkv_bias": self.qkv_bias,
            "kv_channels": self.head_dim,
        }

    def head_width(self, hidden_size: int, heads: int) -> int:
        return self.head_dim or hidden_size // heads

    def embedding_multiplier(self, hidden_size: int) -> float | None:
        return math.sqrt(hidden_size) if self.embedding_scale else None

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one MLP: gate, up and down when gated, else up and down."""
        return 3 if self.gated_mlp else 2
