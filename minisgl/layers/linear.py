"""Tensor-parallel linear layers.

Column-parallel layers split the output features over ranks (no communication);
row-parallel layers split the input features and all-reduce the partial sums.
Parameters are created uninitialized (``torch.empty``) and filled by ``weight_loader``,
which takes the full HF checkpoint tensor and copies this rank's shard::

    merged QKV weight rows:  [ q (local heads) | k (local kv heads) | v (local kv heads) ]
    merged gate_up rows:     [ gate (local) | up (local) ]

On CPU the engine may then call ``pack_for_cpu``: with the compiled AVX-512 kernels and float32
activations the weight moves into the panel layout of ``minisgl.kernels`` (optionally stored
as bfloat16, halving the bytes each decode step reads); otherwise it is pre-packed for
oneDNN's matmul (faster than MKL sgemm on the plain layout for small batches).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import TPGroup
from minisgl.kernels import CpuKernels, cpu_kernels
from minisgl.kernels.cpu import PackedWeight

PACK_BATCH_HINT = 16
"""Batch size oneDNN tunes the packed weight layout for (any batch size works)."""


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class LinearBase(nn.Module):
    """A linear layer holding this rank's shard; subclasses define how it is sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.bias = None
        self.packed: torch.Tensor | None = None
        self.panels: PackedWeight | None = None
        self.kernels: CpuKernels | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def pack_for_cpu(self, weight_dtype: torch.dtype) -> None:
        """Re-lay the loaded weight out for the fastest CPU matmul and drop the plain copy;
        ``weight_dtype`` (float32 or bfloat16) is how panel-packed weights are stored.

        Call once, after loading; afterwards ``weight`` is empty and cannot be reloaded.
        """
        self.panels, self.kernels = pack_panels(self.weight, weight_dtype)
        if self.panels is None:
            weight = self.weight.detach()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        self.weight.data = self.weight.data.new_empty(0)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.panels is not None:
            assert self.kernels is not None
            return self.kernels.linear(x, self.panels, bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


def pack_panels(
    weight: torch.Tensor, weight_dtype: torch.dtype
) -> tuple[PackedWeight | None, CpuKernels | None]:
    """The panel-packed copy of a float32 CPU ``weight`` when the AVX-512 kernels exist."""
    kernels = cpu_kernels()
    if kernels is None or not kernels.native_gemm or weight.dtype != torch.float32:
        return None, None
    return PackedWeight(weight.detach(), weight_dtype), kernels


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shard shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src)


class ColumnParallelLinear(LinearBase):
    """``y = x W^T + b`` with output features split over ranks; output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, _divide(out_features, tp.size, "output features"), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        _copy(param.data, loaded.narrow(0, self.tp.rank * n, n), "column-parallel linear")


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel linears with the same input, fused into one matmul
    (e.g. gate and up projections). ``shard_id`` is the index into ``output_sizes``."""

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], bias: bool, tp: TPGroup
    ) -> None:
        self.local_sizes = [_divide(n, tp.size, "output features") for n in output_sizes]
        super().__init__(in_features, sum(self.local_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset = sum(self.local_sizes[:shard_id])
        n = self.local_sizes[shard_id]
        _copy(
            param.data.narrow(0, offset, n),
            loaded.narrow(0, self.tp.rank * n, n),
            f"merged linear shard {shard_id}",
        )


class QKVParallelLinear(LinearBase):
    """The q, k and v projections fused into one matmul, split by heads over ranks.

    When there are fewer KV heads than ranks, each KV head is replicated on
    ``tp.size // num_kv_heads`` consecutive ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
    ) -> None:
        self.head_dim = head_dim
        self.num_local_heads = _divide(num_heads, tp.size, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_local_kv_heads = _divide(num_kv_heads, tp.size, "key/value heads")
            self.kv_head_start = tp.rank * self.num_local_kv_heads
        else:
            _divide(tp.size, num_kv_heads, "tensor-parallel size over key/value heads")
            self.num_local_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        q_size = self.num_local_heads * head_dim
        kv_size = self.num_local_kv_heads * head_dim
        self.q_size, self.kv_size = q_size, kv_size
        super().__init__(hidden_size, q_size + 2 * kv_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id == "q":
            offset, n, start = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            n, start = self.kv_size, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"unknown QKV shard {shard_id!r}")
        _copy(param.data.narrow(0, offset, n), loaded.narrow(0, start, n), f"qkv shard {shard_id}")


class RowParallelLinear(LinearBase):
    """``y = x W^T + b`` with input features split over ranks; the partial products are
    all-reduced (the bias is added once, on rank 0)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(_divide(in_features, tp.size, "input features"), out_features, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:
            _copy(param.data, loaded, "row-parallel bias")
            return
        n = param.shape[1]
        _copy(param.data, loaded.narrow(1, self.tp.rank * n, n), "row-parallel linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        return self.tp.all_reduce(self._matmul(x, bias))
