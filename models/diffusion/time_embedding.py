"""Time (noise-level) conditioning: an MLP of t added to the input (TimeEmbedding), or adaLN in every layer.

Pure torch, used both by the megatron model (`DiffusionGPTModel` and its layer spec) and by the exported
HF model, with the same parameter names. Output layers start at zero, so a model with time conditioning
switched on starts as the same function as one without it.
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


class Modulation(nn.Module):
    """(shift, scale) [b, hidden] each from t [b]: sinusoidal features -> Linear -> SiLU -> Linear (zero-init)."""

    def __init__(self, hidden_size: int, freq_dim: int = 256, cond_dim: int = 128):
        super().__init__()
        self.freq_dim = freq_dim
        self.linear_1 = nn.Linear(freq_dim, cond_dim)
        self.linear_2 = nn.Linear(cond_dim, 2 * hidden_size)
        nn.init.zeros_(self.linear_2.weight)
        nn.init.zeros_(self.linear_2.bias)

    def forward(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.linear_1(timestep_features(t, self.freq_dim).to(self.linear_1.weight.dtype))
        shift, scale = self.linear_2(torch.nn.functional.silu(h)).chunk(2, dim=-1)
        return shift, scale


class AdaLNorm(nn.Module):
    """Adaptive norm (adaLN, as the DiT blocks of UDLM and DUO): norm(x) * (1 + scale(t)) + shift(t).

    Conditions every layer on the noise level, where an input embedding of t reaches only the first.
    Each norm owns its small modulation MLP (no module shared across layers, so pipeline stages stay
    independent); it starts at zero, so the layer starts as the plain norm. `weight`/`bias` keep the names
    of torch's norms, which megatron's local spec and the HF export both use."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, normalization: str = "RMSNorm"):
        super().__init__()
        self.eps, self.rms = eps, normalization == "RMSNorm"
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(hidden_size))
        self.modulation = Modulation(hidden_size)

    def forward(self, x: torch.Tensor, t: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
        """x [b, s, h] (seq_dim 1) or [s, b, h] (seq_dim 0, megatron's layout); t [b]."""
        shape = (x.shape[-1],)
        if self.rms:
            y = torch.nn.functional.rms_norm(x, shape, self.weight, self.eps)
        else:
            y = torch.nn.functional.layer_norm(x, shape, self.weight, self.bias, self.eps)
        shift, scale = (m.unsqueeze(seq_dim).to(y.dtype) for m in self.modulation(t.to(x.device)))
        return y * (1 + scale) + shift
