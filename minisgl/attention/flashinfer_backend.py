"""FlashInfer backend (CUDA): paged prefill / decode wrappers, planned once per batch.

The pool's per-layer ``[num_slots, kv_heads, head_dim]`` tensors are viewed as FlashInfer's
NHD paged layout ``[num_pages, page_size, kv_heads, head_dim]``. Request ``b``'s pages are
read from the token-granular page table at positions ``0, page_size, 2 * page_size, ...``::

    indptr[b] .. indptr[b+1]  ->  indices = page_table[row, ::page_size] // page_size
    last_page_len[b] = (device_len - 1) % page_size + 1

Prefill uses a causal mask aligned to the end of the keys, i.e. query ``i`` of a request
with ``cached_len`` cached tokens sees keys ``j <= cached_len + i``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minisgl.attention.base import AttentionBackend, AttentionConfig, AttentionMetadata
from minisgl.engine.batch import Batch
from minisgl.kvcache.mha_pool import MHAKVCache

WORKSPACE_BYTES = 256 << 20


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as e:
        raise RuntimeError(
            "attention backend 'flashinfer' needs the flashinfer package "
            "(pip install flashinfer-python); use --attn torch otherwise"
        ) from e
    return flashinfer


@dataclass
class FlashInferMetadata(AttentionMetadata):
    wrapper: Any
    """The planned prefill or decode wrapper to ``run`` in every layer."""
    is_decode: bool


@dataclass
class _PageIndex:
    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


class FlashInferBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, config: AttentionConfig, kv_cache: MHAKVCache) -> None:
        if config.device.type != "cuda":
            raise RuntimeError(
                f"attention backend 'flashinfer' needs a CUDA device (got {config.device}); "
                "use --attn torch on CPU"
            )
        super().__init__(config, kv_cache)
        self.fi = _import_flashinfer()
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=config.device)
        self.use_tensor_cores = config.num_heads // config.num_kv_heads >= 4
        self.prefill_wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = self._decode_wrapper()
        self.graph_wrappers: dict[int, Any] = {}
        self.max_graph_batch = 0

    def _decode_wrapper(self, **graph_buffers: torch.Tensor) -> Any:
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=bool(graph_buffers),
            use_tensor_cores=self.use_tensor_cores,
            **graph_buffers,
        )

    def _page_index(self, batch: Batch) -> _PageIndex:
        ps = self.config.page_size
        seq = torch.tensor(batch.device_len, dtype=torch.int32)
        num_pages = (seq + ps - 1) // ps
        longest = int(num_pages.max())
        rows = batch.page_table[torch.tensor(batch.table_idx), : longest * ps : ps]
        valid = torch.arange(longest).unsqueeze(0) < num_pages.unsqueeze(1)
        indices = (rows[valid] // ps).to(torch.int32)
        indptr = torch.zeros(batch.size + 1, dtype=torch.int32)
        torch.cumsum(num_pages, 0, out=indptr[1:])
        last = (seq - 1) % ps + 1
        dev = self.config.device
        return _PageIndex(
            indptr.to(dev, non_blocking=True),
            indices.to(dev, non_blocking=True),
            last.to(dev, non_blocking=True),
        )

    def _plan_args(self) -> tuple[int, int, int, int]:
        c = self.config
        return c.num_heads, c.num_kv_heads, c.head_dim, c.page_size

    def _plan_decode(self, wrapper: Any, pages: _PageIndex) -> None:
        c = self.config
        wrapper.plan(
            pages.indptr,
            pages.indices,
            pages.last_page_len,
            *self._plan_args(),
            pos_encoding_mode="NONE",
            sm_scale=c.scale,
            q_data_type=c.dtype,
            kv_data_type=c.dtype,
        )

    def prepare(self, batch: Batch) -> AttentionMetadata:
        pages = self._page_index(batch)
        if batch.is_decode:
            self._plan_decode(self.decode_wrapper, pages)
            return FlashInferMetadata(self.decode_wrapper, True)
        qo_indptr = torch.zeros(batch.size + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(batch.extend_lens, dtype=torch.int32), 0, out=qo_indptr[1:])
        c = self.config
        self.prefill_wrapper.plan(
            qo_indptr.to(c.device, non_blocking=True),
            pages.indptr,
            pages.indices,
            pages.last_page_len,
            *self._plan_args(),
            causal=True,
            sm_scale=c.scale,
            q_data_type=c.dtype,
            kv_data_type=c.dtype,
        )
        return FlashInferMetadata(self.prefill_wrapper, False)

    def forward(
        self, q: torch.Tensor, layer_id: int, kv_cache: MHAKVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        assert isinstance(metadata, FlashInferMetadata)
        c = self.config
        shape = (kv_cache.num_pages, c.page_size, c.num_kv_heads, c.head_dim)
        paged = (kv_cache.k_cache(layer_id).view(shape), kv_cache.v_cache(layer_id).view(shape))
        return metadata.wrapper.run(q.contiguous(), paged)

    def init_cuda_graph(self, max_batch_size: int) -> None:
        self.max_graph_batch = max_batch_size

    def prepare_for_capture(self, batch_size: int) -> AttentionMetadata:
        """A CUDA-graph decode wrapper for ``batch_size`` requests, planned on the pad page."""
        if not 0 < batch_size <= self.max_graph_batch:
            raise ValueError(f"batch size {batch_size} outside captured range")
        dev = self.config.device
        max_pages = -(-self.kv_cache.num_slots // self.config.page_size)
        wrapper = self._decode_wrapper(
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.ones(batch_size, dtype=torch.int32, device=dev),
        )
        pages = _PageIndex(
            torch.arange(batch_size + 1, dtype=torch.int32, device=dev),
            torch.zeros(batch_size, dtype=torch.int32, device=dev),
            torch.ones(batch_size, dtype=torch.int32, device=dev),
        )
        self._plan_decode(wrapper, pages)
        self.graph_wrappers[batch_size] = wrapper
        return FlashInferMetadata(wrapper, True)

    def prepare_for_replay(self, batch: Batch, metadata: AttentionMetadata) -> None:
        """Re-plan the captured wrapper for ``batch`` (same batch size as captured)."""
        assert isinstance(metadata, FlashInferMetadata) and batch.is_decode
        self._plan_decode(metadata.wrapper, self._page_index(batch))
