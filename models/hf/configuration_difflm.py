"""Hugging Face config of an exported difflm model (copied into every export folder)."""

from transformers import PretrainedConfig

# In an export folder this reads `from .arch import ModelArch` (`convert.export_code` rewrites the prefix).
from ..diffusion.arch import ModelArch

# The flat fields exports carried before the `architecture` entry: read into the record, no longer written.
_LEGACY_ARCH = ("hidden_act", "gated_mlp", "normalization", "qk_layernorm", "qkv_bias", "head_dim")


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
        architecture: dict | None = None,
        norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 128,
        bidirectional: bool = True,
        model_running_mode: str = "difflm-noshift",
        mask_token_id: int | None = None,
        mask_token_added: bool = False,
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
        legacy = {k: kwargs.pop(k) for k in _LEGACY_ARCH if k in kwargs}
        # the network's switches (models/diffusion/arch.py), whole; old exports: from their flat fields
        record = ModelArch(**architecture) if architecture else ModelArch.from_hf_config(legacy)
        self.architecture = record.to_dict()
        self.norm_eps = norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.bidirectional = bidirectional
        self.model_running_mode = model_running_mode
        self.mask_token_id = mask_token_id
        self.mask_token_added = mask_token_added  # new in the vocabulary (an import's): out of ar's normaliser
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
