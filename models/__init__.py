"""Diffusion LMs: `diffusion` (pure maths) <- `megatron` (training) <- `hf` (export) <- `evaluation`; `launch`.

Arrows point at what a package may import; `tests/unit/test_layout.py` checks them.
"""
