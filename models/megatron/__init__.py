"""Training on megatron-core: model from its specs, forward step, data, trainer, checkpoints, CPU compatibility.

May import `difflm.models.diffusion`, `difflm.config` and megatron-core (never `difflm.models.hf`, evaluation or launch).
The name shadows nothing: `megatron.core` still resolves to the installed megatron-core (absolute imports).
"""
