"""The torch attention backend against a direct per-request softmax(QK^T)V reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from minisgl.attention import AttentionConfig, create_backend, resolve_backend_name, torch_backend
from minisgl.engine.batch import Batch
from minisgl.kvcache.mha_pool import MHAKVCache

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 6, 2, 8, 2
MAX_SEQ = 96


def _setup(
    page_size: int,
    num_pages: int = 64,
    seed: int = 0,
    layout: str = "interleaved",
    dtype: torch.dtype = torch.float32,
    head_dim: int = HEAD_DIM,
    kv_dtype: torch.dtype | None = None,
):
    torch.manual_seed(seed)
    pool = MHAKVCache(
        LAYERS, num_pages, page_size, KV_HEADS, head_dim, kv_dtype or dtype, "cpu", layout=layout
    )
    for layer in range(LAYERS):
        pool.k_cache(layer).normal_()
        pool.v_cache(layer).normal_()
    config = AttentionConfig(
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=head_dim,
        page_size=page_size,
        device=torch.device("cpu"),
        dtype=dtype,
        scale=head_dim**-0.5,
        kv_dtype=kv_dtype,
    )
    return pool, create_backend("torch", config, pool)


def _batch(pool: MHAKVCache, lens: list[tuple[int, int]], seed: int) -> Batch:
    """Requests with (cached_len, extend_len); pages drawn from a shuffled free list."""
    rng = random.Random(seed)
    pages = list(range(pool.num_pages))
    rng.shuffle(pages)
    ps = pool.page_size
    rows = len(lens) + 2
    table = torch.zeros(rows, MAX_SEQ, dtype=torch.int32)
    table_idx = rng.sample(range(rows), len(lens))
    out_loc = []
    for row, (cached, ext) in zip(table_idx, lens, strict=True):
        for pos in range(cached + ext):
            if pos % ps == 0:
                page = pages.pop()
            table[row, pos] = page * ps + pos % ps
        out_loc += table[row, cached : cached + ext].tolist()
    return Batch(
        table_idx=table_idx,
        cached_len=[c for c, _ in lens],
        device_len=[c + e for c, e in lens],
        input_ids=[0] * sum(e for _, e in lens),
        out_loc=torch.tensor(out_loc, dtype=torch.int64),
        page_table=table,
    )


def _reference(q, pool: MHAKVCache, layer: int, batch: Batch) -> torch.Tensor:
    outs, start = [], 0
    group = HEADS // KV_HEADS
    for row, cached, total in zip(batch.table_idx, batch.cached_len, batch.device_len, strict=True):
        ext = total - cached
        slots = batch.page_table[row, :total].long()
        k = pool.k_cache(layer)[slots].double().repeat_interleave(group, dim=1)
        v = pool.v_cache(layer)[slots].double().repeat_interleave(group, dim=1)
        qi = q[start : start + ext].double()
        scores = torch.einsum("ihd,jhd->hij", qi, k) / math.sqrt(q.shape[-1])
        allowed = torch.arange(total)[None, :] <= cached + torch.arange(ext)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hij,jhd->ihd", scores.softmax(-1), v))
        start += ext
    return torch.cat(outs).to(q.dtype)


CASES = {
    "decode_uniform": [(9, 1), (9, 1), (9, 1)],
    "decode_ragged": [(0, 1), (30, 1), (5, 1), (61, 1)],
    "prefill_single": [(0, 23)],
    "prefill_single_cached": [(16, 9)],
    "prefill_ragged": [(0, 5), (12, 20), (4, 1), (0, 31)],
    "prefill_similar": [(8, 12), (0, 19), (5, 15)],
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("pad_limit", [0.0, 1e9], ids=["loop", "padded"])
@pytest.mark.parametrize("layout", ["interleaved", "separate"])
def test_torch_backend_matches_reference(page_size, case, pad_limit, layout, monkeypatch):
    """The pure-torch paths (compiled CPU kernels switched off)."""
    monkeypatch.setattr(torch_backend, "PAD_WASTE_LIMIT", pad_limit)
    pool, backend = _setup(page_size, num_pages=512 // page_size, layout=layout)
    backend.kernels = None
    batch = _batch(pool, CASES[case], seed=page_size)
    md = backend.prepare(batch)
    for layer in range(LAYERS):
        q = torch.randn(len(batch.input_ids), HEADS, HEAD_DIM)
        got = backend.forward(q, layer, pool, md).reshape(q.shape)
        torch.testing.assert_close(got, _reference(q, pool, layer, batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layout", ["interleaved", "separate"])
@pytest.mark.parametrize(
    "dtype, kv_dtype",
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)],
    ids=["fp32", "bf16", "fp32-bf16kv"],
)
@pytest.mark.parametrize("max_extend", [1, 16])
@pytest.mark.parametrize("head_dim", [8, 64], ids=["portable", "avx512"])
def test_cpu_kernel_backend_matches_reference(
    page_size, case, layout, dtype, kv_dtype, max_extend, head_dim, monkeypatch
):
    """The compiled paged kernel for short requests, SDPA for the rest, in one batch; queries
    are a strided view as the models pass them. Head dims that are multiples of 16 take the
    AVX-512 path where the CPU has it."""
    monkeypatch.setattr(torch_backend, "KERNEL_MAX_EXTEND", max_extend)
    pool, backend = _setup(
        page_size,
        num_pages=512 // page_size,
        layout=layout,
        dtype=dtype,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
    )
    if backend.kernels is None:
        pytest.skip("no C compiler: CPU kernels unavailable")
    batch = _batch(pool, CASES[case], seed=page_size)
    md = backend.prepare(batch)
    assert isinstance(md, torch_backend.TorchKernelMetadata)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert pool.dtype == (kv_dtype or dtype)
    for layer in range(LAYERS):
        qkv = torch.randn(len(batch.input_ids), HEADS + 2 * KV_HEADS, head_dim).to(dtype)
        q = qkv[:, :HEADS]
        got = backend.forward(q, layer, pool, md).reshape(q.shape)
        torch.testing.assert_close(got, _reference(q, pool, layer, batch), atol=tol, rtol=tol)


@pytest.mark.parametrize("layout", ["interleaved", "separate"])
def test_store_writes_rows_and_keeps_pad_slot_zero(layout):
    pool, _ = _setup(page_size=4, num_pages=8, layout=layout)
    k = torch.randn(3, KV_HEADS, HEAD_DIM)
    v = torch.randn(3, KV_HEADS, HEAD_DIM)
    loc = torch.tensor([5, 0, 31])
    pool.store(1, k, v, loc)
    torch.testing.assert_close(pool.k_cache(1)[loc], k)
    torch.testing.assert_close(pool.v_cache(1)[loc], v)
    assert pool.k_cache(1).shape == (32, KV_HEADS, HEAD_DIM)
    assert not pool.k_buffer(0)[pool.pad_slot :].any()
    assert not pool.v_buffer(1)[pool.pad_slot :].any()


def test_backend_names():
    cpu = torch.device("cpu")
    assert resolve_backend_name("auto", cpu) == "torch"
    assert resolve_backend_name("torch,torch", cpu) == "torch"
    assert resolve_backend_name("flashinfer,torch", cpu) == "flashinfer,torch"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        resolve_backend_name("nope", cpu)
    with pytest.raises(ValueError, match="PREFILL,DECODE"):
        resolve_backend_name("torch,torch,torch", cpu)


def test_flashinfer_without_cuda_is_a_clear_error():
    pool, backend = _setup(page_size=1, num_pages=8)
    with pytest.raises(RuntimeError, match="flashinfer"):
        create_backend("flashinfer", backend.config, pool)
