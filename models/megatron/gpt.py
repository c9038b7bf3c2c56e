"""The diffusion LM on megatron-core: GPTModel composed from layer specs, never forked.

Bidirectional attention (masked diffusion) is one spec parameter, `attn_mask_type=no_mask`; the
autoregressive baseline keeps megatron's causal mask. The rest is megatron's own GPTModel.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.utils.hooks import RemovableHandle

from difflm.config import ModelConfig, PipelineConfig
from difflm.models.diffusion.arch import ModelArch
from difflm.models.diffusion.modes import Objective
from difflm.models.diffusion.time_embedding import AdaLNorm, TimeEmbedding
from difflm.models.megatron import compiled
from difflm.models.megatron.attention import block_spec, torch_layer_spec
from difflm.models.megatron.backend import resolve_backend
from difflm.models.megatron.forward_step import configured_document_form, document_form
from difflm.models.megatron.kernels import check_cuda_graphs, kernel_settings

# The MLP activation of each `ModelArch.activation` (GELU's tanh approximation is Gemma's gelu_pytorch_tanh)
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def padded_vocab_size(vocab_size: int, tensor_parallel: int, multiple: int = 64) -> int:
    """Megatron shards the embedding by TP rank: pad the vocabulary to a multiple of multiple*TP."""
    step = multiple * tensor_parallel
    return (vocab_size + step - 1) // step * step


def uses_adaln(cfg: PipelineConfig, objective: Objective) -> bool:
    return objective.time_conditioned(cfg.diffusion.time_embedding) and cfg.diffusion.time_conditioning == "adaln"


class ZeroCenteredNorm(torch.nn.Module):
    """RMSNorm / LayerNorm scaling by (1 + w), w starting at zero (Gemma's norm): megatron's
    `layernorm_zero_centered_gamma` for the local and torch specs, whose torch norms refuse that flag (Transformer
    Engine's norms read it themselves). Built as megatron builds norms, `norm(config, hidden_size, eps)`."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.rms, self.shape, self.eps = config.normalization == "RMSNorm", (hidden_size,), eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for p in self.parameters():  # as TorchNorm: replicated across TP, all-reduced under SP
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # megatron's mark

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return F.rms_norm(x, self.shape, self.weight + 1, self.eps)
        return F.layer_norm(x, self.shape, self.weight + 1, self.bias, self.eps)


def zero_centered(spec, config):
    """The block spec of `spec` with every norm (both of each layer's, the q/k norms, the final one) zero-centred."""
    attn = spec.submodules.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attn, name) is not IdentityOp:
            setattr(attn, name, ZeroCenteredNorm)
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = ZeroCenteredNorm
    layers = [spec] * get_num_layers_to_build(config)
    submodules = TransformerBlockSubmodules(layer_specs=layers, layer_norm=ZeroCenteredNorm)
    return ModuleSpec(module=TransformerBlock, submodules=submodules)


class MegatronAdaLNorm(AdaLNorm):
    """The spec's norm module for adaLN: megatron builds it as norm(config, hidden_size, eps) and calls it
    with hidden states only, so t reaches it through a holder the model fills before each forward."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps, config.normalization)
        self.time: types.SimpleNamespace | None = None  # set by DiffusionGPTModel: .t is this forward's t [b]
        for p in self.parameters():  # replicated across TP; under SP each rank sees s/TP positions:
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # megatron all-reduces their grads

    def forward(self, hidden_states):
        return super().forward(hidden_states, self.time.t, seq_dim=0)  # megatron's [s, b, h]


def layer_spec(
    model: ModelConfig,
    bidirectional: bool,
    backend: str = "local",
    adaln: bool = False,
    documents: str | None = None,
    two_stream: bool = False,
    annealed: bool = False,
):
    """Megatron's own layer spec with the attention mask kind chosen by the objective; with `adaln`, its two
    norms swapped for t-modulated ones (a spec change, megatron's TransformerLayer is untouched).

    `documents` is the form packed documents take (`forward_step.document_form`, by default the backend's).
    `two_stream` (block diffusion): the local spec takes the dense [b, 1, 2L, 2L] mask (arbitrary); the torch
    spec a `TwoStreamMask` that carries its own rule; Transformer Engine is refused. `annealed`: the forward step
    passes DiffuLLaMA's annealed [b, 1, s, s] mask (`diffusion.attention_anneal_steps`)."""
    if two_stream and backend == "te":
        raise RuntimeError(
            "block diffusion (difflm-block) needs model.backend=torch or local: Transformer Engine's attention "
            "takes causal / padding masks and THD sequences, not the [x_t | x_0] block mask"
        )
    if backend == "te":
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=ModelArch.of(model).qk_norm)
    else:
        arch = ModelArch.of(model)
        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization=arch.normalization)
    if backend == "torch":
        spec = torch_layer_spec(spec)
    dense = backend == "local" and two_stream
    if dense or annealed or (model.document_attention and (documents or document_form(backend)) == "dense"):
        mask = AttnMaskType.arbitrary  # the [b, 1, s, s] mask is built per batch from document boundaries
    else:  # a DocumentMask carries its own direction; under THD, TE takes causal / no_mask as
        # padding_causal / padding within each sequence (megatron's TEDotProductAttention maps them)
        mask = AttnMaskType.no_mask if bidirectional else AttnMaskType.causal
    spec.submodules.self_attention.params["attn_mask_type"] = mask
    if adaln:
        if backend == "te":
            raise RuntimeError(
                "diffusion.time_conditioning=adaln needs model.backend=torch or local: Transformer Engine fuses "
                "the input norm into the QKV projection. Or set diffusion.time_conditioning=input."
            )
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = MegatronAdaLNorm
    return spec


# model.recompute -> megatron's activation recompute: selective checkpoints the core attention and the MLP (the
# MLP's 3 x ffn activations are the largest saved tensors), full every layer from its input (uniform, 1 layer a unit)
RECOMPUTE: dict[str, dict] = {
    "off": {},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


# model.cuda_graphs -> megatron's own CUDA graphs (no Transformer Engine): every layer's forward and backward
# captured after cuda_graph_warmup_steps; an empty scope is the whole layer
CUDA_GRAPHS: dict[str, dict] = {"off": {}, "layers": {"cuda_graph_impl": "local", "cuda_graph_scope": []}}


def transformer_config(cfg: PipelineConfig, backend: str = "local"):
    """Our small ModelConfig mapped onto megatron's TransformerConfig, in this one function."""
    m, p = cfg.model, cfg.parallel
    on_cpu = not torch.cuda.is_available()
    check_cuda_graphs(m.cuda_graphs, cuda=not on_cpu)
    bf16 = cfg.train.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    kernels = kernel_settings(cfg)
    arch = ModelArch.of(m)
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups or m.num_attention_heads,
        ffn_hidden_size=m.ffn_size,
        gated_linear_unit=arch.gated_mlp,
        activation_func=ACTIVATIONS[arch.activation],
        normalization=arch.normalization,
        layernorm_zero_centered_gamma=arch.norm_offset == 1,
        layernorm_epsilon=m.norm_epsilon,
        qk_layernorm=arch.qk_norm,
        kv_channels=arch.head_dim,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=m.dropout,
        attention_dropout=m.dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=bf16,
        fp8=cfg.train.fp8,
        # the loss function returns (sum, count); megatron divides by the global count, so the loss and its
        # gradient do not depend on the micro-batch / data-parallel split (MegaDLMs' loss_func does the same)
        calculate_per_token_loss=True,
        # Fusions need CUDA kernels; on the CPU they must be off (see models/megatron/compat.py). Those that
        # run without TE / apex are chosen in models/megatron/kernels.py; the others need them.
        use_cpu_initialization=on_cpu,
        masked_softmax_fusion=not on_cpu and backend == "te",
        bias_activation_fusion=kernels.swiglu_fusion,
        cross_entropy_loss_fusion=kernels.cross_entropy_fusion,
        cross_entropy_fusion_impl="native",
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        **RECOMPUTE[m.recompute],
        **CUDA_GRAPHS[m.cuda_graphs],
    )


# a change of this rank's logits [s, b, V/TP] (its vocabulary slice) -> logits of the same shape
OutputTransform = Callable[[torch.Tensor], torch.Tensor]


class DiffusionGPTModel(GPTModel):
    """megatron's GPTModel with optional time conditioning: everything else is GPTModel's own code.

    The output layer's logits pass through one forward hook of this class (`_transform_output`): the transforms
    added with `add_output_transform`, in order, then the rows no token is set to -inf, always last. A transform
    registered as a hook of its own would run after the -inf and could make those rows finite again (a cap, a
    bias), so the hook refuses to run when another was registered after it."""

    time: types.SimpleNamespace  # t of the current forward, read by this stage's adaLN norms

    def __init__(
        self,
        *args,
        time_embedding: bool = False,
        adaln: bool = False,
        embedding_multiplier: float | None = None,
        scored_vocab: int | None = None,
        never_targets: tuple[int, ...] = (),
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        # exact likelihoods: the normaliser is the vocabulary (None: every row is a token's)
        self.scored_vocab = scored_vocab if self.post_process else None
        self.never_targets = never_targets
        self.output_transforms: list[OutputTransform] = []
        self._output_hook: RemovableHandle | None = None
        if self.scored_vocab is not None:
            self._hook_output()
        self.embedding_multiplier = embedding_multiplier if self.pre_process else None  # Gemma: x sqrt(hidden)
        # Only the first pipeline stage embeds tokens, so only it owns the input time embedding.
        input_emb = time_embedding and not adaln and self.pre_process
        self.time_embedding = TimeEmbedding(self.config.hidden_size) if input_emb else None
        if self.time_embedding is not None:  # under SP each TP rank adds it to s/TP positions only:
            for p in self.time_embedding.parameters():  # megatron all-reduces grads marked so
                p.sequence_parallel = self.config.sequence_parallel  # type: ignore[attr-defined]  # megatron's mark
        self.time = types.SimpleNamespace(t=None)  # read by this stage's adaLN norms during forward
        self.adaln = adaln
        for module in self.modules():
            if isinstance(module, MegatronAdaLNorm):
                module.time = self.time

    def add_output_transform(self, transform: OutputTransform) -> None:
        """Apply `transform` to this stage's logits, after the transforms added before it and before the rows no
        token is are set to -inf (which stays last, so they stay -inf whatever the transform does)."""
        if not self.post_process:
            raise RuntimeError("only the last pipeline stage has an output layer: add the transform there")
        self.output_transforms.append(transform)
        self._hook_output()

    def _hook_output(self) -> None:
        if self._output_hook is None:
            self._output_hook = self.output_layer.register_forward_hook(self._transform_output)

    def _transform_output(self, module, _args, output):
        if next(reversed(module._forward_hooks)) != self._output_hook.id:
            raise RuntimeError(
                "a forward hook was registered on output_layer after DiffusionGPTModel's, so it would run after the "
                "padding rows are set to -inf: add it with add_output_transform instead"
            )
        logits, bias = output
        for transform in self.output_transforms:
            logits = transform(logits)
        return self._unscored_rows_out(logits), bias

    def _unscored_rows_out(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits of -inf for the rows no token is: the padding up to a multiple of 64 x TP, and `never_targets` (a
        mask token the import added). This rank holds the vocabulary slice [rank * v, (rank + 1) * v)."""
        if self.scored_vocab is None:
            return logits
        local = logits.shape[-1]
        first = self.pg_collection.tp.rank() * local
        rows = torch.arange(first, first + local, device=logits.device)
        out = rows >= self.scored_vocab
        for row in self.never_targets:
            out |= rows == row
        return logits.masked_fill(out, float("-inf"))

    def forward(self, input_ids, position_ids, attention_mask, labels=None, t=None, two_stream=False, **kwargs):
        """megatron's forward; `two_stream` (block diffusion): the input is [x_t | x_0] and RoPE gives both halves
        positions 0..L-1 (megatron's RoPE ignores position_ids: its table is swapped for this forward)."""
        if two_stream:
            return self._two_stream_forward(input_ids, position_ids, attention_mask, labels, t, **kwargs)
        if (self.time_embedding is not None or self.adaln) and t is None:
            raise ValueError("this model was built with diffusion.time_embedding=true: pass t")
        packed = kwargs.get("packed_seq_params")
        thd = packed is not None and packed.qkv_format == "thd"
        if thd and self.adaln:
            raise RuntimeError("adaLN time conditioning takes one t per row: not with THD packed sequences")
        if self.time_embedding is not None or self.embedding_multiplier:
            emb = self.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, b, h]
            if self.embedding_multiplier:
                emb = emb * self.embedding_multiplier
            if self.time_embedding is not None:
                time = self.time_embedding(t).to(emb.dtype)  # [b, h]
                emb = emb + (self._per_token(time, emb.shape[0]) if thd else time.unsqueeze(0))
            kwargs["decoder_input"] = emb
        self.time.t = t
        try:
            return super().forward(input_ids, position_ids, attention_mask, labels=labels, **kwargs)
        finally:
            self.time.t = None

    def _two_stream_forward(self, input_ids, position_ids, attention_mask, labels, t, **kwargs):
        rope = getattr(self, "rotary_pos_emb", None)
        if rope is None:
            raise RuntimeError("block diffusion needs RoPE positions")
        table = rope.forward

        def halves(seq_len, *args, **kw):  # [2L, 1, 1, d]: positions 0..L-1 twice
            emb = table(seq_len // 2, *args, **kw)
            return torch.cat([emb, emb], dim=0)

        rope.forward = halves
        try:
            return self.forward(input_ids, position_ids, attention_mask, labels, t, **kwargs)
        finally:
            del rope.forward

    def _per_token(self, time: torch.Tensor, local_tokens: int) -> torch.Tensor:
        """[t_local, 1, h]: each token of a THD row [1, b*s] gets the time embedding of its row ([b, h]).
        Under SP this rank holds tokens [rank * t_local, (rank + 1) * t_local) of the row; a plain index
        (not a scatter) keeps each rank's gradient to its own tokens, summed over TP like the params'."""
        tp = self.pg_collection.tp
        parts = tp.size() if self.config.sequence_parallel else 1
        first = tp.rank() * local_tokens if parts > 1 else 0
        seq_length = local_tokens * parts // time.shape[0]
        row = torch.arange(first, first + local_tokens, device=time.device) // seq_length
        return time[row].unsqueeze(1)


def build_model(
    cfg: PipelineConfig,
    vocab_size: int,
    pre_process: bool = True,
    post_process: bool = True,
    padded_vocab: int | None = None,
    never_targets: tuple[int, ...] = (),
    *,
    objective: Objective,
) -> DiffusionGPTModel:
    """One pipeline stage of the megatron GPTModel for `cfg` and its `objective` (the caller's, built once where its
    run starts: `build_objective`) (the whole model when PP=1).

    `padded_vocab` overrides the embedding rows (conversion builds a TP=1 model with the padding of the
    layout it writes for). An objective with an exact likelihood (ar) normalises over the `vocab_size` tokens only:
    the padding rows, and the `never_targets` (a mask token an import added), get logits of -inf, so the NLL of an
    imported model is the source's."""
    backend = resolve_backend(cfg.model.backend, objective.two_stream)
    if cfg.train.fp8 and backend != "te":
        raise RuntimeError(
            "train.fp8 needs the Transformer Engine backend on a GPU (pip install "
            "'difflm-pipeline[gpu]'); set train.fp8=null here."
        )
    if cfg.parallel.sequence_parallel and backend == "local":
        raise RuntimeError(
            "parallel.sequence_parallel needs model.backend=torch or te: megatron-core's local spec uses torch "
            "norms that refuse it. Set model.backend=torch (or parallel.sequence_parallel=false)."
        )
    tcfg = transformer_config(cfg, backend)
    arch = ModelArch.of(cfg.model)
    if arch.norm_offset and uses_adaln(cfg, objective):
        raise RuntimeError(
            "model.norm_offset=1 with diffusion.time_conditioning=adaln: the adaLN norms take their scale from t, "
            "not (1 + w); set diffusion.time_conditioning=input"
        )
    spec = layer_spec(
        cfg.model,
        objective.bidirectional,
        backend,
        uses_adaln(cfg, objective),
        configured_document_form(cfg, objective),
        objective.two_stream,
        annealed=cfg.diffusion.attention_anneal_steps > 0,
    )
    if arch.norm_offset and backend != "te":  # Transformer Engine's norms read the config's flag themselves
        spec = zero_centered(spec, tcfg)
    elif backend == "torch":  # the final norm as well must accept sequence parallelism
        spec = block_spec(spec, tcfg)
    model = DiffusionGPTModel(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab or padded_vocab_size(vocab_size, cfg.parallel.tensor_model_parallel_size),
        max_sequence_length=cfg.train.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.model.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=cfg.model.rotary_base,
        time_embedding=objective.time_conditioned(cfg.diffusion.time_embedding),
        adaln=uses_adaln(cfg, objective),
        embedding_multiplier=arch.embedding_multiplier(cfg.model.hidden_size),
        scored_vocab=vocab_size if objective.exact else None,
        never_targets=never_targets,
    )
    compiled.apply(model, cfg.model.compile)
    return model
