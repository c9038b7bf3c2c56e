"""Time (noise-level) conditioning: sinusoidal features of t -> MLP -> added to token embeddings.

Pure torch, used both by the megatron model (as a submodule of `DiffusionGPTModel`) and by the exported
HF model, with the same parameter names. The output layer starts at zero, so a model with the time
embedding switched on starts as the same function as one without it.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def timestep_features(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of t in [0, 1] (scaled to [0, 1000]). [b] -> [b, dim]"""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimeEmbedding(nn.Module):
    def __init__(self, hidden_size: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.linear_1 = nn.Linear(freq_dim, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear_2.weight)
        nn.init.zeros_(self.linear_2.bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """[b] noise levels -> [b, hidden]"""
        h = self.linear_1(timestep_features(t, self.freq_dim).to(self.linear_1.weight.dtype))
        return self.linear_2(torch.nn.functional.silu(h))
