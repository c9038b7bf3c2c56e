"""After training: likelihood reports and samples of an export, and the export + evaluate stage functions.

May import `models.diffusion`, `models.hf` and `difflm.config` (never `models.megatron`: it scores the export).
"""
