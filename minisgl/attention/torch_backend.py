"""The reference backend: paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

Works on any device. On CPU (float32 / bfloat16) requests with few new tokens -- decodes and
short extends -- run in one compiled kernel call that reads K/V straight from the pool pages
(``minisgl.kernels``); longer extends use SDPA per request. Elsewhere ``prepare`` turns the
host page table into device page indices once per batch; each layer then does one gather of
whole pages (one ``index_select``; with the interleaved pool layout it fetches K and V
together) and one batched SDPA.

Request ``b`` attends from its positions ``[cached_len, device_len)`` to keys ``[0, device_len)``::

    key j:    0 ..... cached_len ........ device_len ..... L = pages * page_size (padded)
    query i:  may see j <= cached_len + i              |  masked (pad page / stale slots)

Pages past a request's last one point at the pool's zero pad page. Decode (one query per
request) folds the query heads that share a KV head into SDPA's query length
(``[B, kv_heads, group, head_dim]``), so KV heads are never expanded. Prefill pads the batch
to ``[B, max_extend]`` queries when that wastes little, and otherwise loops over requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionBackend, AttentionConfig, AttentionMetadata
from minisgl.engine.batch import Batch
from minisgl.kernels import CpuKernels, cpu_kernels
from minisgl.kernels.cpu import MAX_GROUP, MAX_HEAD_DIM, MAX_TASK_DIM
from minisgl.kvcache.mha_pool import MHAKVCache

PAD_WASTE_LIMIT = 1.5
"""Prefill pads the batch when padded attention work <= this times the ragged work."""
KERNEL_MAX_EXTEND = 16
"""With CPU kernels, requests with at most this many new tokens use the paged kernel."""


@dataclass
class TorchDecodeMetadata(AttentionMetadata):
    pages: torch.Tensor
    """int64 ``[B, P]`` pool pages of each request (the pad page past its last one)."""
    mask: torch.Tensor | None
    """bool ``[B, 1, 1, P * page_size]`` (True = attend); None when nothing is padded."""


@dataclass
class _Segment:
    start: int
    end: int
    pages: torch.Tensor
    """int64 ``[1, pages of this request]``."""
    mask: torch.Tensor | None
    """bool ``[1, 1, extend, keys]``; None when the request has no cached prefix."""


@dataclass
class TorchPrefillMetadata(AttentionMetadata):
    pages: torch.Tensor | None
    """int64 ``[B, P]`` (None in loop mode)."""
    mask: torch.Tensor | None
    """bool ``[B, 1, E, P * page_size]`` prefix-causal mask; None when ``causal`` suffices."""
    causal: bool
    """One request with no cached prefix: SDPA's own causal mask is exact."""
    q_dst: torch.Tensor | None
    """int64 ``[T]``: row of each query in the padded ``[B * E]`` layout (None when B == 1)."""
    max_extend: int
    segments: list[_Segment] | None = None
    """Loop mode: one entry per request."""


@dataclass
class TorchKernelMetadata(AttentionMetadata):
    """CPU kernels: the short requests in one kernel call, the long ones one SDPA each."""

    pages: torch.Tensor | None
    """int64 ``[R, P]`` pages of the R short requests (None when there are none)."""
    q_start: torch.Tensor | None
    """int64 ``[R]``: first query row of each short request."""
    q_len: torch.Tensor | None
    kv_len: torch.Tensor | None
    segments: list[_Segment]


class TorchBackend(AttentionBackend):
    def __init__(self, config: AttentionConfig, kv_cache: MHAKVCache) -> None:
        super().__init__(config, kv_cache)
        self.group = config.num_heads // config.num_kv_heads
        self.kernels = self._cpu_kernels(config)

    def _cpu_kernels(self, config: AttentionConfig) -> CpuKernels | None:
        kv_dtype = config.kv_dtype or config.dtype
        if config.device.type != "cpu" or config.dtype not in CpuKernels.DTYPES:
            return None
        if kv_dtype not in CpuKernels.DTYPES:
            return None
        if config.head_dim > MAX_HEAD_DIM or self.group > MAX_GROUP:
            return None
        if self.group * config.head_dim > MAX_TASK_DIM:
            return None
        return cpu_kernels()

    def prepare(self, batch: Batch) -> AttentionMetadata:
        ps, dev = self.config.page_size, self.config.device
        seq = torch.tensor(batch.device_len, dtype=torch.int64)
        num_pages = (seq + ps - 1) // ps
        longest = int(num_pages.max())
        rows = torch.tensor(batch.table_idx)
        pages = batch.page_table[rows, : longest * ps : ps].to(torch.int64)
        if ps > 1:
            pages = pages.div_(ps, rounding_mode="floor")
        padded = bool((seq != longest * ps).any())
        if padded:
            pages.masked_fill_(
                torch.arange(longest) >= num_pages.unsqueeze(1), self.kv_cache.pad_page
            )
        if self.kernels is not None:
            return self._prepare_kernel(batch, pages, num_pages)
        if batch.is_decode:
            mask = None
            if padded:
                keys = torch.arange(longest * ps)
                mask = (keys < seq.unsqueeze(1)).view(batch.size, 1, 1, -1).to(dev)
            return TorchDecodeMetadata(pages=pages.to(dev), mask=mask)
        return self._prepare_prefill(batch, pages, num_pages, seq)

    def _prepare_prefill(
        self, batch: Batch, pages: torch.Tensor, num_pages: torch.Tensor, seq: torch.Tensor
    ) -> TorchPrefillMetadata:
        dev, ext = self.config.device, batch.extend_lens
        max_ext, keys = max(ext), pages.shape[1] * self.config.page_size
        if batch.size == 1 and batch.cached_len[0] == 0:
            return TorchPrefillMetadata(pages.to(dev), None, True, None, max_ext)
        work = sum(e * d for e, d in zip(ext, batch.device_len, strict=True))
        if batch.size > 1 and batch.size * max_ext * keys > PAD_WASTE_LIMIT * work:
            return self._prepare_loop(batch, pages, num_pages)
        cached = torch.tensor(batch.cached_len, dtype=torch.int64)
        mask = _prefix_causal_mask(cached, seq, max_ext, keys).unsqueeze(1).to(dev)
        if batch.size == 1:
            return TorchPrefillMetadata(pages.to(dev), mask, False, None, max_ext)
        ext_t = torch.tensor(ext, dtype=torch.int64)
        starts = torch.arange(batch.size) * max_ext
        q_dst = torch.repeat_interleave(starts - torch.cumsum(ext_t, 0) + ext_t, ext_t)
        q_dst += torch.arange(q_dst.shape[0])
        return TorchPrefillMetadata(pages.to(dev), mask, False, q_dst.to(dev), max_ext)

    def _prepare_loop(
        self, batch: Batch, pages: torch.Tensor, num_pages: torch.Tensor
    ) -> TorchPrefillMetadata:
        starts = _starts(batch.extend_lens)
        segments = self._segments(batch, pages, num_pages, range(batch.size), starts)
        return TorchPrefillMetadata(None, None, False, None, max(batch.extend_lens), segments)

    def _prepare_kernel(
        self, batch: Batch, pages: torch.Tensor, num_pages: torch.Tensor
    ) -> TorchKernelMetadata:
        ext = batch.extend_lens
        short = [b for b, e in enumerate(ext) if e <= KERNEL_MAX_EXTEND]
        long = [b for b, e in enumerate(ext) if e > KERNEL_MAX_EXTEND]
        starts = _starts(ext)
        segments = self._segments(batch, pages, num_pages, long, starts)
        if not short:
            return TorchKernelMetadata(None, None, None, None, segments)
        if long:
            pages = pages.index_select(0, torch.tensor(short))
        return TorchKernelMetadata(
            pages=pages,
            q_start=torch.tensor([starts[b] for b in short], dtype=torch.int64),
            q_len=torch.tensor([ext[b] for b in short], dtype=torch.int64),
            kv_len=torch.tensor([batch.device_len[b] for b in short], dtype=torch.int64),
            segments=segments,
        )

    def _segments(
        self,
        batch: Batch,
        pages: torch.Tensor,
        num_pages: torch.Tensor,
        which: Iterable[int],
        starts: list[int],
    ) -> list[_Segment]:
        """One SDPA segment for each request in ``which``; ``starts[b]`` is request b's first
        token row."""
        dev, ps = self.config.device, self.config.page_size
        segments = []
        for b in which:
            c, d, n = batch.cached_len[b], batch.device_len[b], int(num_pages[b])
            mask = None
            if c > 0:
                c_t, d_t = torch.tensor([c]), torch.tensor([d])
                mask = _prefix_causal_mask(c_t, d_t, d - c, n * ps).unsqueeze(1).to(dev)
            segments.append(
                _Segment(starts[b], starts[b] + d - c, pages[b : b + 1, :n].to(dev), mask)
            )
        return segments

    def forward(
        self, q: torch.Tensor, layer_id: int, kv_cache: MHAKVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        if isinstance(metadata, TorchKernelMetadata):
            return self._forward_kernel(q, layer_id, kv_cache, metadata)
        if isinstance(metadata, TorchDecodeMetadata):
            k, v = self._gather(kv_cache, layer_id, metadata.pages)
            return self._decode(q, k, v, metadata)
        assert isinstance(metadata, TorchPrefillMetadata)
        if metadata.segments is not None:
            return self._run_segments(q, kv_cache, layer_id, metadata.segments, torch.empty_like(q))
        assert metadata.pages is not None
        k, v = self._gather(kv_cache, layer_id, metadata.pages)
        return self._prefill_padded(q, k, v, metadata)

    def _gather(
        self, kv_cache: MHAKVCache, layer_id: int, pages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``pages`` (``[B, P]``) as ``[B, kv_heads, P * page_size, head_dim]``, in
        the query dtype."""
        b, n = pages.shape
        ps, hk, d = self.config.page_size, self.config.num_kv_heads, self.config.head_dim
        flat = pages.view(-1)
        if kv_cache.layout == "interleaved":
            buf = kv_cache.kv_buffer(layer_id)
            kv = buf.view(-1, ps * buf[0].numel()).index_select(0, flat)
            kv = kv.to(self.config.dtype).view(b, n * ps, 2, hk, d).permute(2, 0, 3, 1, 4)
            return kv[0], kv[1]
        k_buf, v_buf = kv_cache.k_buffer(layer_id), kv_cache.v_buffer(layer_id)
        k = k_buf.view(-1, ps * hk * d).index_select(0, flat).view(b, n * ps, hk, d)
        v = v_buf.view(-1, ps * hk * d).index_select(0, flat).view(b, n * ps, hk, d)
        return k.transpose(1, 2).to(self.config.dtype), v.transpose(1, 2).to(self.config.dtype)

    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: TorchDecodeMetadata
    ) -> torch.Tensor:
        b, hk, d = q.shape[0], self.config.num_kv_heads, self.config.head_dim
        out = F.scaled_dot_product_attention(
            q.view(b, hk, self.group, d), k, v, attn_mask=md.mask, scale=self.config.scale
        )
        return out.view(b, hk * self.group, d)

    def _prefill_padded(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: TorchPrefillMetadata
    ) -> torch.Tensor:
        num_b, h, d = k.shape[0], q.shape[1], q.shape[2]
        if md.q_dst is None:
            qp = q.unsqueeze(0)
        else:
            qp = q.new_zeros(num_b * md.max_extend, h, d)
            qp.index_copy_(0, md.q_dst, q)
            qp = qp.view(num_b, md.max_extend, h, d)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2),
            k,
            v,
            attn_mask=md.mask,
            is_causal=md.causal,
            scale=self.config.scale,
            enable_gqa=self.group > 1,
        ).transpose(1, 2)
        if md.q_dst is None:
            return out[0]
        return out.reshape(num_b * md.max_extend, h, d).index_select(0, md.q_dst)

    def _forward_kernel(
        self, q: torch.Tensor, layer_id: int, kv_cache: MHAKVCache, md: TorchKernelMetadata
    ) -> torch.Tensor:
        out = q.new_empty(q.shape)
        if md.pages is not None:
            assert self.kernels is not None
            assert md.q_start is not None and md.q_len is not None and md.kv_len is not None
            self.kernels.paged_attention(
                q,
                kv_cache.k_buffer(layer_id),
                kv_cache.v_buffer(layer_id),
                md.pages,
                self.config.page_size,
                md.q_start,
                md.q_len,
                md.kv_len,
                self.config.scale,
                out,
            )
        return self._run_segments(q, kv_cache, layer_id, md.segments, out)

    def _run_segments(
        self,
        q: torch.Tensor,
        kv_cache: MHAKVCache,
        layer_id: int,
        segments: list[_Segment],
        out: torch.Tensor,
    ) -> torch.Tensor:
        """SDPA of each segment's queries against its gathered pages, written into ``out``."""
        for seg in segments:
            k, v = self._gather(kv_cache, layer_id, seg.pages)
            out[seg.start : seg.end] = F.scaled_dot_product_attention(
                q[seg.start : seg.end].transpose(0, 1).unsqueeze(0),
                k,
                v,
                attn_mask=seg.mask,
                is_causal=seg.mask is None,
                scale=self.config.scale,
                enable_gqa=self.group > 1,
            )[0].transpose(0, 1)
        return out


def _starts(extend_lens: list[int]) -> list[int]:
    """First token row of each request in the batch's flattened tokens."""
    starts, acc = [], 0
    for e in extend_lens:
        starts.append(acc)
        acc += e
    return starts


def _prefix_causal_mask(
    cached: torch.Tensor, seq: torch.Tensor, max_extend: int, keys: int
) -> torch.Tensor:
    """bool ``[B, max_extend, keys]``: query i of request b sees key j iff
    ``j <= cached[b] + i`` and ``j < seq[b]``."""
    j = torch.arange(keys).view(1, 1, -1)
    limit = cached.view(-1, 1, 1) + torch.arange(max_extend).view(1, -1, 1)
    return (j <= limit) & (j < seq.view(-1, 1, 1))
