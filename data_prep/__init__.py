"""Data prep on datatrove: raw text -> cleaned, split, tokenized, verified Megatron .bin/.idx.

May import `difflm` (config, errors), datatrove, tokenizers and megatron-core's dataset reader.
"""
