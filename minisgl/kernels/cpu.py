"""Typed Python entry points to the compiled CPU kernels (``cpu_kernels.c``).

Callers check ``supports`` first and keep a torch path for everything else (other dtypes,
devices or shapes, or no C compiler on the machine).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from minisgl.kernels.build import load_library

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM = 256
MAX_TASK_DIM = 8192
"""Query heads x head_dim one attention task holds (``MAX_TASK_DIM`` in cpu_kernels.c)."""
MAX_GROUP = 64
"""Query heads per KV head (``MAX_TASK_HEADS`` in cpu_kernels.c)."""
MAX_NORM_WIDTH = 8192

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "paged_attention": [_P, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, _P, _P, _P]
    + [_I64, _I64, _I64, _I64, _F32, _P, _I64, _INT, _INT],
    "rms_norm": [_P, _P, _P, _P, _I64, _I64, _F32, _INT, _INT],
    "rotary": [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _INT],
    "gemm_packed": [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _INT],
}
PANEL = 32
"""Output rows per weight panel of ``gemm_packed`` (see ``cpu_kernels.c``)."""


class PackedWeight:
    """A ``[N, K]`` linear weight re-laid out in panels of 32 output rows for ``linear``."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        n, k = weight.shape
        panels = -(-n // PANEL)
        padded = weight.new_zeros(panels * PANEL, k)
        padded[:n] = weight
        self.data = padded.view(panels, PANEL, k).transpose(1, 2).contiguous().to(dtype)
        self.out_features = n
        self.in_features = k


class CpuKernels:
    """Attention over the paged pool, fused residual-add + RMSNorm, and in-place rotary."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {}
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
            self._fns[name] = fn
        self.native_gemm = bool(lib.gemm_native())
        """Whether ``linear`` runs the AVX-512 kernel (else a slow portable loop)."""

    DTYPES = tuple(_DTYPE_CODES)

    @staticmethod
    def supports(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.dtype in _DTYPE_CODES

    def paged_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pages: torch.Tensor,
        page_size: int,
        q_start: torch.Tensor,
        q_len: torch.Tensor,
        kv_len: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Attention of queries ``q`` (``[T, heads, head_dim]``, last dim contiguous) into
        ``out`` (contiguous, same shape) for the requests described by the int64 tensors
        ``q_start``, ``q_len``, ``kv_len`` (``[R]``) and ``pages`` (``[R, P]``, contiguous; key
        ``j`` is at slot ``pages[r, j // page_size] * page_size + j % page_size``).

        ``k`` / ``v`` are one layer's pool rows (``[slots, kv_heads, head_dim]`` views that
        share a slot stride; float32 or bfloat16, independently of ``q``); query ``i`` of
        request ``r`` sees its keys ``[0, kv_len - q_len + i]``.
        """
        heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = k.shape[1]
        self._fns["paged_attention"](
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            pages.data_ptr(),
            pages.stride(0),
            page_size,
            q_start.data_ptr(),
            q_len.data_ptr(),
            kv_len.data_ptr(),
            q_start.shape[0],
            heads,
            kv_heads,
            head_dim,
            scale,
            out.data_ptr(),
            out.stride(0),
            _DTYPE_CODES[q.dtype],
            _DTYPE_CODES[k.dtype],
        )

    def linear(
        self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W^T + bias`` for float32 ``x`` (``[..., K]``) and a packed weight."""
        x2 = x.reshape(-1, weight.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = x2.new_empty(x2.shape[0], weight.out_features)
        self._fns["gemm_packed"](
            x2.data_ptr(),
            x2.shape[0],
            x2.stride(0),
            weight.data.data_ptr(),
            weight.out_features,
            weight.in_features,
            bias.data_ptr() if bias is not None else None,
            out.data_ptr(),
            out.stride(0),
            _DTYPE_CODES[weight.data.dtype],
        )
        return out.view(*x.shape[:-1], weight.out_features)

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``norm(x) * weight``, or with ``residual``: ``residual += x`` in place, then
        ``norm(residual) * weight``. ``x`` / ``residual``: contiguous ``[rows, width]``."""
        out = torch.empty_like(x)
        self._fns["rms_norm"](
            x.data_ptr(),
            residual.data_ptr() if residual is not None else None,
            weight.data_ptr(),
            out.data_ptr(),
            x.numel() // x.shape[-1],
            x.shape[-1],
            eps,
            residual is not None,
            _DTYPE_CODES[x.dtype],
        )
        return out

    def rotary(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Rotate ``x`` (``[T, heads, head_dim]``, last dim contiguous) in place at int64
        ``positions`` using ``[max_positions, head_dim]`` cos / signed-sin tables."""
        self._fns["rotary"](
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            x.stride(0),
            x.stride(1),
            x.shape[2],
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
            _DTYPE_CODES[x.dtype],
        )


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The process's compiled CPU kernels, or None where they cannot be built."""
    lib = load_library()
    return CpuKernels(lib) if lib is not None else None
