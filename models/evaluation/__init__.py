"""After training: likelihood reports and samples of an export, and the export + evaluate stage functions.

May import `difflm.models.diffusion`, `difflm.models.hf` and `difflm.config` (never `difflm.models.megatron`: it scores the export).
"""
