"""Hugging Face config of an exported difflm model (copied into every export folder)."""

from transformers import PretrainedConfig


class DiffLMConfig(PretrainedConfig):
    model_type = "difflm"

    def __init__(
        self,
        vocab_size: int = 4096,
        real_vocab_size: int | None = None,
        hidden_size: int = 64,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        intermediate_size: int = 176,
        hidden_act: str = "silu",
        gated_mlp: bool = True,
        normalization: str = "RMSNorm",
        norm_eps: float = 1e-5,
        qk_layernorm: bool = False,
        qkv_bias: bool = False,
        head_dim: int | None = None,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 128,
        bidirectional: bool = True,
        model_running_mode: str = "difflm-noshift",
        mask_token_id: int | None = None,
        time_embedding: bool = False,
        time_conditioning: str = "input",
        document_attention: bool = False,
        objective: dict | None = None,
        special_ids: list[int] | None = None,
        tie_word_embeddings: bool = True,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.real_vocab_size = real_vocab_size or vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.gated_mlp = gated_mlp
        self.normalization = normalization
        self.norm_eps = norm_eps
        self.qk_layernorm = qk_layernorm
        self.qkv_bias = qkv_bias  # biases on the fused Q/K/V projection (Qwen2)
        self.head_dim = head_dim  # width of one head; None: hidden_size // num_attention_heads (Qwen3 sets it)
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.bidirectional = bidirectional
        self.model_running_mode = model_running_mode
        self.mask_token_id = mask_token_id
        self.time_embedding = time_embedding
        self.time_conditioning = time_conditioning  # "input": embedding added to tokens; "adaln": every norm
        self.document_attention = document_attention  # attention kept within EOS-separated documents
        # the mode's settings as trained ({"mode": ..., setting: value}, `Objective.to_dict`); None in exports
        # written before it, which kept a few as fields of their own (`modeling_difflm.export_objective` reads both)
        self.objective = objective
        if objective:
            self.model_running_mode = objective["mode"]
        self.special_ids = list(special_ids or [])
        self.initializer_range = initializer_range
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
