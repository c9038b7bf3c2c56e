"""The model section and the architecture presets."""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from difflm.config.base import IF_SET, OPERATIONAL, _Section
from difflm.errors import ConfigWarning

# (hidden >= GPU_WIDTH) give an FFN width that is a multiple of GEMM_TILE: 8/3*hidden rounded to 8 (5464 for the
# 1B) leaves partial GEMM tiles on every MLP matmul (+0.5-1 MFU point on a GPU).
GEMM_TILE = 128
GPU_WIDTH = 1024
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4},  # ~1M (+ embeddings)
    "small": {"num_layers": 6, "hidden_size": 256, "num_attention_heads": 4},  # ~5M
    # 70m and 250m: the ends of the literature's data-constrained studies (72M-257M with a 32k vocabulary)
    "70m": {"num_layers": 10, "hidden_size": 640, "num_attention_heads": 10, "ffn_hidden_size": 1792},
    "125m": {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12},
    "250m": {"num_layers": 17, "hidden_size": 1024, "num_attention_heads": 16, "ffn_hidden_size": 2816},
    "350m": {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "ffn_hidden_size": 2816},
    "1b": {
        "num_layers": 24,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_query_groups": 8,
        "ffn_hidden_size": 5632,
    },
    "3b": {
        "num_layers": 32,
        "hidden_size": 2560,
        "num_attention_heads": 32,
        "num_query_groups": 8,
        "ffn_hidden_size": 6912,
    },
    "7b": {
        "num_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_query_groups": 8,
        "ffn_hidden_size": 11008,
    },
}


class ModelConfig(_Section):
    preset: Literal["tiny", "small", "70m", "125m", "250m", "350m", "1b", "3b", "7b"] | None = Field(
        None, description="Architecture preset; fields given alongside override it."
    )
    backend: Literal["auto", "torch", "local", "te"] = Field(
        "auto",
        description="Layer spec. auto: 'te' on CUDA with Transformer Engine installed, else 'torch' (also on the "
        "CPU, where it gives the local spec's logits to ~1e-7 and trains faster). torch: megatron-core's layers with PyTorch scaled_dot_product_attention "
        "(flash/cuDNN kernels on GPUs; FlexAttention block masks for document_attention) and norms that support "
        "sequence parallelism. local: megatron-core's reference spec (unfused softmax). te: Transformer Engine "
        "(fused attention, fp8).",
    )
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = Field(
        "auto",
        json_schema_extra=OPERATIONAL,
        description="The torch backend's SDPA kernel. auto: PyTorch's choice (the trainer logs which); flash, "
        "cudnn, efficient (CUDA only) or math: forced around the forward and backward (an error if that kernel "
        "cannot take the inputs).",
    )
    fusions: Literal["auto", "off"] = Field(
        "auto",
        json_schema_extra=OPERATIONAL,
        description="auto: on CUDA, megatron's compiled SwiGLU (bias_activation_fusion), its native fused "
        "cross-entropy (bf16) and torch's fused AdamW; the CPU keeps the reference path. off: the reference path "
        "everywhere (the trainer logs the settings in use).",
    )
    recompute: Literal["off", "selective", "full"] = Field(
        "off",
        json_schema_extra=OPERATIONAL,
        description="Activation recompute (megatron's recompute_granularity): the backward recomputes what the "
        "forward did not keep, for larger micro-batches in the same memory (the same numbers, more time). "
        "selective: the core attention and the MLP of every layer; full: every layer from its input.",
    )
    compile: Literal["off", "rope", "layers"] = Field(
        "off",
        json_schema_extra=OPERATIONAL,
        description="torch.compile for the elementwise work, without Transformer Engine: rope compiles the rotary "
        "embedding; layers compiles every transformer layer whole (norms, residual adds, RoPE and activations "
        "fused). The same numbers up to the fused kernels' rounding; compiles cost seconds per process.",
    )
    cuda_graphs: Literal["off", "layers"] = Field(
        "off",
        json_schema_extra=OPERATIONAL,
        description="CUDA graphs (CUDA only): layers captures every transformer layer's forward and backward as "
        "graphs after a few warm-up steps (megatron's cuda_graph_impl=local), so a small model's step is not "
        "bound by launching kernels. The same numbers; static shapes (one micro-batch size and length per run).",
    )
    num_layers: int = Field(2, ge=1)
    hidden_size: int = Field(64, ge=8)
    num_attention_heads: int = Field(4, ge=1)
    num_query_groups: int | None = Field(None, ge=1, description="GQA groups (None: as many as heads).")
    ffn_hidden_size: int | None = Field(None, ge=1, description="None: 4*hidden (or 8/3*hidden with a gated MLP).")
    gated_mlp: bool = Field(
        True,
        # its old name (model.swiglu) in the run-directory hash, so runs named before the rename keep their names
        serialization_alias="swiglu",
        description="A gated MLP: act(gate) * up ([gate; up] rows). Was model.swiglu (still accepted).",
    )
    activation: Literal["silu", "gelu", "gelu_tanh"] | None = Field(
        None,
        json_schema_extra=IF_SET,
        description="The MLP's activation; gelu_tanh: GELU's tanh approximation (Gemma). None: silu when gated "
        "(SwiGLU), else gelu.",
    )
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    norm_offset: Literal[0, 1] = Field(
        0,
        json_schema_extra=IF_SET,
        description="Norms scale by (norm_offset + w): 1 is Gemma's (1 + w) RMSNorm, weights stored zero-centred.",
    )
    embedding_scale: bool = Field(
        False, json_schema_extra=IF_SET, description="Token embeddings times sqrt(hidden_size) (Gemma)."
    )
    rotary_base: int = Field(10000, ge=1)
    qk_layernorm: bool = False
    tie_embeddings: bool = True
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    init_method_std: float = Field(0.02, gt=0.0)
    norm_epsilon: float = Field(1e-5, gt=0.0)
    qkv_bias: bool = Field(
        False, json_schema_extra=IF_SET, description="Biases on the Q, K and V projections (Qwen2); none elsewhere."
    )
    kv_channels: int | None = Field(
        None,
        ge=1,
        json_schema_extra=IF_SET,
        description="Width of one attention head (HF head_dim; Qwen3 sets it apart from hidden/heads). "
        "None: hidden_size / num_attention_heads.",
    )
    hf_architecture: Literal["llama", "qwen2", "qwen3", "mistral", "gemma"] | None = Field(
        None,
        json_schema_extra=OPERATIONAL,
        description="The stock transformers class an `ar` export takes (recorded by `difflm convert HF_DIR`); "
        "None: the class whose switches the model has (models/hf/architectures.py; Llama by default). Exports only: "
        "training is the same.",
    )
    document_attention: bool = Field(
        False, description="Packed documents attend only within themselves (explicit mask on the local spec)."
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and "swiglu" in data:  # the old name, accepted for one release
            data = {k: v for k, v in data.items() if k != "swiglu"} | {"gated_mlp": data["swiglu"]}
        if isinstance(data, dict) and data.get("activation") == ("silu" if data.get("gated_mlp", True) else "gelu"):
            data = {**data, "activation": None}  # the default pairing, spelt out: the same run, the same name
        if isinstance(data, dict) and data.get("preset") in MODEL_PRESETS:
            return {**MODEL_PRESETS[data["preset"]], **data}
        return data

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by num_query_groups ({groups})"
            )
        return self

    @field_validator("fusions", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _ffn_fills_gemm_tiles(self) -> ModelConfig:
        if self.hidden_size >= GPU_WIDTH and self.ffn_size % GEMM_TILE:
            warnings.warn(
                f"model.ffn_hidden_size={self.ffn_size} is not a multiple of {GEMM_TILE}: on GPUs every MLP matmul "
                f"leaves partial tiles; e.g. model.ffn_hidden_size={-(-self.ffn_size // GEMM_TILE) * GEMM_TILE}",
                ConfigWarning,
                stacklevel=2,
            )
        return self

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.gated_mlp:  # keeps the parameter count of a 4h GELU MLP, rounded to a multiple of 8
            return int(8 * self.hidden_size / 3 + 7) // 8 * 8
        return 4 * self.hidden_size
