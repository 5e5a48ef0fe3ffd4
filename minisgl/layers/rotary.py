"""Rotary position embedding (the non-interleaved "rotate half" form used by HF Llama).

The cos / sin tables are computed once for all positions ``[0, max_positions)``; a batch
looks its positions up once (``lookup``) and every layer reuses the result
(``RotaryBatch.apply``). On CPU in float32 / bfloat16 the compiled kernel rotates in place
straight from the tables instead.
The sign of ``rotate_half`` is folded into the sin table::

    rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from minisgl.kernels import CpuKernels, cpu_kernels
from minisgl.models.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Per-pair inverse frequencies (float32, ``[head_dim // 2]``) after rope scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos / sin tables in the default dtype at construction time."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(head_dim, rope).to(torch.get_default_device())
        t = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq)
        sin = freqs.sin()
        dtype = torch.get_default_dtype()
        self.register_buffer("cos_table", freqs.cos().repeat(1, 2).to(dtype), persistent=False)
        self.register_buffer(
            "sin_table", torch.cat([-sin, sin], dim=-1).to(dtype), persistent=False
        )

    def lookup(self, positions: torch.Tensor) -> RotaryBatch:
        """The rotation of one batch's positions ``[T]`` (int64), shared by all layers."""
        kernels = cpu_kernels() if CpuKernels.supports(self.cos_table) else None
        if kernels is not None and self.head_dim <= 256:
            return RotaryBatch(positions, self.cos_table, self.sin_table, kernels)
        cos = self.cos_table.index_select(0, positions).unsqueeze(1)
        sin = self.sin_table.index_select(0, positions).unsqueeze(1)
        return RotaryBatch(positions, cos, sin, None)


@dataclass(frozen=True)
class RotaryBatch:
    """With ``kernels``: ``cos`` / ``sin`` are the whole ``[max_positions, head_dim]`` tables;
    without: the looked-up rows, ``[T, 1, head_dim]``."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    kernels: CpuKernels | None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (``[T, heads, head_dim]``); may work in place and return ``x``."""
        if self.kernels is not None and x.stride(-1) == 1:
            self.kernels.rotary(x, self.positions, self.cos, self.sin)
            return x
        cos, sin = self.cos, self.sin
        if self.kernels is not None:
            cos = cos.index_select(0, self.positions).unsqueeze(1)
            sin = sin.index_select(0, self.positions).unsqueeze(1)
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        return torch.addcmul(x * cos, swapped, sin)
