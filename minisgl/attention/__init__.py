"""Attention backends by name; optional kernel libraries are imported only when selected.

``attn`` names: ``torch``, ``flashinfer``, ``auto`` (flashinfer on CUDA when installed, else
torch), or ``"PREFILL,DECODE"`` to use one backend for prefill batches and another for decode.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from minisgl.attention.base import AttentionBackend, AttentionConfig, AttentionMetadata
from minisgl.engine.batch import Batch
from minisgl.kvcache.mha_pool import MHAKVCache

_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("minisgl.attention.torch_backend", "TorchBackend"),
    "flashinfer": ("minisgl.attention.flashinfer_backend", "FlashInferBackend"),
}

__all__ = [
    "AttentionBackend",
    "AttentionConfig",
    "AttentionMetadata",
    "backend_names",
    "create_backend",
    "resolve_backend_name",
]


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """Expand ``auto`` for ``device``; validate every part of ``PREFILL,DECODE`` names."""
    parts = [p.strip() for p in name.split(",")]
    if len(parts) > 2 or not all(parts):
        raise ValueError(f"bad attention backend {name!r}: use NAME or PREFILL,DECODE")
    resolved = []
    for part in parts:
        if part == "auto":
            has_fi = importlib.util.find_spec("flashinfer") is not None
            part = "flashinfer" if device.type == "cuda" and has_fi else "torch"
        if part not in _BACKENDS:
            raise ValueError(
                f"unknown attention backend {part!r}; choose auto or one of {backend_names()}"
            )
        resolved.append(part)
    if len(resolved) == 2 and resolved[0] == resolved[1]:
        resolved = resolved[:1]
    return ",".join(resolved)


def create_backend(name: str, config: AttentionConfig, kv_cache: MHAKVCache) -> AttentionBackend:
    """Build the backend named ``name`` (see module doc) for ``config`` and ``kv_cache``."""
    parts = resolve_backend_name(name, config.device).split(",")
    backends = [_load(part)(config, kv_cache) for part in parts]
    if len(backends) == 1:
        return backends[0]
    return HybridBackend(config, kv_cache, prefill=backends[0], decode=backends[1])


def _load(name: str) -> type[AttentionBackend]:
    module, attr = _BACKENDS[name]
    return getattr(importlib.import_module(module), attr)


class _HybridMetadata(AttentionMetadata):
    def __init__(self, backend: AttentionBackend, inner: AttentionMetadata) -> None:
        self.backend = backend
        self.inner = inner


class HybridBackend(AttentionBackend):
    """One backend for prefill (and mixed) batches, another for pure decode batches."""

    def __init__(
        self,
        config: AttentionConfig,
        kv_cache: MHAKVCache,
        prefill: AttentionBackend,
        decode: AttentionBackend,
    ) -> None:
        super().__init__(config, kv_cache)
        self.prefill_backend = prefill
        self.decode_backend = decode
        self.supports_cuda_graph = decode.supports_cuda_graph

    def prepare(self, batch: Batch) -> AttentionMetadata:
        backend = self.decode_backend if batch.is_decode else self.prefill_backend
        return _HybridMetadata(backend, backend.prepare(batch))

    def forward(
        self, q: torch.Tensor, layer_id: int, kv_cache: MHAKVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        assert isinstance(metadata, _HybridMetadata)
        return metadata.backend.forward(q, layer_id, kv_cache, metadata.inner)

    def init_cuda_graph(self, max_batch_size: int) -> None:
        self.decode_backend.init_cuda_graph(max_batch_size)

    def prepare_for_capture(self, batch_size: int) -> AttentionMetadata:
        return _HybridMetadata(
            self.decode_backend, self.decode_backend.prepare_for_capture(batch_size)
        )

    def prepare_for_replay(self, batch: Batch, metadata: AttentionMetadata) -> None:
        assert isinstance(metadata, _HybridMetadata)
        self.decode_backend.prepare_for_replay(batch, metadata.inner)
