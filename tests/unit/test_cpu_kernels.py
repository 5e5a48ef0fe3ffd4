"""The compiled CPU kernels (RMSNorm, rotary, panel matmul) against torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.kernels import cpu_kernels
from minisgl.kernels.cpu import PackedWeight
from minisgl.layers import RMSNorm, RotaryEmbedding
from minisgl.models.config import RopeConfig

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C compiler: no CPU kernels")

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 8e-3}


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed


@DTYPES
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_with_and_without_residual(dtype, rows):
    torch.manual_seed(rows)
    weight = torch.randn(576).mul(0.3).add(1.0).to(dtype)
    x = torch.randn(rows, 576).to(dtype)
    res = torch.randn(rows, 576).to(dtype)
    kernels = cpu_kernels()
    torch.testing.assert_close(
        kernels.rms_norm(x, weight, 1e-5), _rms_norm_reference(x, weight, 1e-5), **_tol(dtype)
    )
    got_res = res.clone()
    got = kernels.rms_norm(x, weight, 1e-5, got_res)
    torch.testing.assert_close(got_res, res + x, atol=0, rtol=0)
    torch.testing.assert_close(got, _rms_norm_reference(res + x, weight, 1e-5), **_tol(dtype))


def test_rms_norm_layer_falls_back_for_strided_input():
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.normal_()
    x = torch.randn(5, 128)[:, :64]
    torch.testing.assert_close(norm(x), _rms_norm_reference(x, norm.weight, 1e-6))


@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_matches_torch(dtype, head_dim):
    rope_cfg = RopeConfig(theta=10000.0)
    with torch.device("cpu"):
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            rotary = RotaryEmbedding(head_dim, 4096, rope_cfg)
        finally:
            torch.set_default_dtype(old)
    positions = torch.tensor([0, 5, 4095, 17, 1000], dtype=torch.int64)
    qkv = torch.randn(5, 9 + 3 + 3, head_dim).to(dtype)
    expect = qkv.clone()
    cos = rotary.cos_table.index_select(0, positions).unsqueeze(1)
    sin = rotary.sin_table.index_select(0, positions).unsqueeze(1)
    ref = expect[:, :12]
    swapped = ref.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    expect[:, :12] = torch.addcmul(ref * cos, swapped, sin)
    batch = rotary.lookup(positions)
    assert batch.kernels is not None
    out = batch.apply(qkv[:, :12])
    assert out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv, expect, **_tol(dtype))


@pytest.mark.parametrize("rows", [1, 3, 12, 13, 40])
@pytest.mark.parametrize("shape", [(96, 64), (50, 7), (3072, 576)], ids=str)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_panel_linear_matches_f_linear(rows, shape, weight_dtype):
    """Every tile height (1..12 and remainders), ragged last panels, K not a multiple of 16,
    bias or not; bf16 storage equals F.linear on the bf16-rounded weight."""
    torch.manual_seed(rows)
    n, k = shape
    weight, bias = torch.randn(n, k), torch.randn(n)
    x = torch.randn(rows, k)
    packed = PackedWeight(weight, weight_dtype)
    reference_weight = weight.to(weight_dtype).float()
    kernels = cpu_kernels()
    tol = {"atol": 1e-4 * k**0.5, "rtol": 1e-4}
    torch.testing.assert_close(
        kernels.linear(x, packed, bias), F.linear(x, reference_weight, bias), **tol
    )
    torch.testing.assert_close(kernels.linear(x, packed, None), x @ reference_weight.T, **tol)
