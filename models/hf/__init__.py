"""The Hugging Face side: the model code shipped in every export, and conversion both ways.

`modeling_difflm`/`configuration_difflm` may import only `difflm.models.diffusion` (copied into the export) and
transformers; `convert`, the bridge, also reads and writes megatron checkpoints through `difflm.models.megatron`.
"""
