"""RMSNorm, optionally fused with the residual add that precedes it (one compiled kernel on
CPU for contiguous float32 / bfloat16 rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.kernels import CpuKernels, cpu_kernels
from minisgl.kernels.cpu import MAX_NORM_WIDTH


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 for low-precision inputs."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.dim = dim
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def _kernels(self, x: torch.Tensor) -> CpuKernels | None:
        if (
            self.dim > MAX_NORM_WIDTH
            or x.dtype != self.weight.dtype
            or not x.is_contiguous()
            or not CpuKernels.supports(x)
        ):
            return None
        return cpu_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self._kernels(x)
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.dim,), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x``; returns ``(norm(residual), residual)``."""
        kernels = self._kernels(x)
        if kernels is not None and residual.is_contiguous():
            return kernels.rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual.add_(x)
        return self(residual), residual
