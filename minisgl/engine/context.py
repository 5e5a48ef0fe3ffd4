"""The one per-forward context: what ``AttentionLayer`` needs to reach the KV pool.

The engine opens it around a single model forward; it refuses nesting and is cleared on
exit, so nothing leaks from one batch into the next.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from minisgl.attention.base import AttentionBackend, AttentionMetadata
    from minisgl.kvcache.mha_pool import MHAKVCache


@dataclass(frozen=True)
class ForwardContext:
    backend: AttentionBackend
    kv_cache: MHAKVCache
    metadata: AttentionMetadata
    out_loc: torch.Tensor
    """int64 ``[num tokens]``: the pool slot of each token's new K/V."""


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` current for the duration of one forward."""
    global _current
    if _current is not None:
        raise RuntimeError("a forward context is already active (nested forwards are not allowed)")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    """The active forward context; raises outside ``forward_context``."""
    if _current is None:
        raise RuntimeError("no active forward context: attention layers run only inside a forward")
    return _current
