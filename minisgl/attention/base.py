"""The attention backend interface.

The engine calls ``prepare`` once per batch (host page table -> device index tensors, masks,
kernel plans); every layer then calls ``forward`` with the same metadata. Backends that
support CUDA graphs also implement the capture / replay hooks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from minisgl.engine.batch import Batch
from minisgl.kvcache.mha_pool import MHAKVCache


@dataclass(frozen=True)
class AttentionConfig:
    """What every backend needs to know about the model and the pool (local to this rank)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    device: torch.device
    dtype: torch.dtype
    scale: float
    kv_dtype: torch.dtype | None = None
    """The KV pool's dtype when it differs from ``dtype`` (torch backend on CPU only)."""


class AttentionMetadata:
    """Per-batch data built by ``prepare``; each backend defines its own subclass."""


class AttentionBackend(ABC):
    """Computes attention of a batch's queries against the K/V pool."""

    supports_cuda_graph: bool = False

    def __init__(self, config: AttentionConfig, kv_cache: MHAKVCache) -> None:
        self.config = config
        self.kv_cache = kv_cache

    @abstractmethod
    def prepare(self, batch: Batch) -> AttentionMetadata:
        """Build this batch's metadata; called once per batch, before any layer runs."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, layer_id: int, kv_cache: MHAKVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """``q``: ``[T, heads, head_dim]`` (T = the batch's extend tokens, in batch order);
        K/V of this batch are already stored in ``kv_cache``. Returns ``[T, heads, head_dim]``
        (or any tensor reshapeable to ``[T, heads * head_dim]``)."""

    def init_cuda_graph(self, max_batch_size: int) -> None:
        """Allocate static buffers for capturing decode batches up to ``max_batch_size``."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch_size: int) -> AttentionMetadata:
        """Metadata bound to the static buffers, for capturing a decode of ``batch_size``."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, batch: Batch, metadata: AttentionMetadata) -> None:
        """Refill the static buffers behind ``metadata`` with ``batch`` before a replay."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
