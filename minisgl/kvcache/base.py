"""The prefix-cache contract that the naive and radix caches both honour.

A prefix cache maps token sequences to the KV slots that hold them, so a new request whose
prompt starts with a cached sequence reuses those slots instead of recomputing them::

    token_ids   0 ................ cached_len ................ len(token_ids)
                |  held by the cache  |       not cached          |
    indices     |  cached slots       |
                 ^ whole pages only: cached_len % page_size == 0

Ownership. The cache owns every slot it holds, always in whole pages (page ``p`` is slots
``[p * page_size, (p + 1) * page_size)``). A caller that hands slots to ``insert_prefix``
gives up those the cache keeps and must free the ones it reports as duplicates.

Accounting (tokens). Each cached token is either *protected* (on the path from the root to
at least one locked handle) or *evictable*; ``size == protected_size + evictable_size``.
Locking a handle moves the tokens of every node on its path whose lock count goes 0 -> 1
from evictable to protected; unlocking moves them back on 1 -> 0. Only evictable tokens can
be evicted, so a locked prefix is never freed.

Handles. A handle names a cached prefix (its ``cached_len`` tokens). It stays valid across
later matches and inserts; an unlocked handle may be invalidated by ``evict``, so lock it
before anything can evict (``lock_handle`` raises ``ValueError`` on an evicted handle).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

EMPTY_INDICES = torch.empty(0, dtype=torch.int32)


@dataclass(frozen=True)
class PrefixMatch:
    """Result of ``match_prefix``: the longest cached, page-aligned prefix of the query."""

    handle: object
    cached_len: int
    indices: torch.Tensor
    """int32 slots of positions ``[0, cached_len)``."""


@dataclass(frozen=True)
class InsertResult:
    """Result of ``insert_prefix``.

    After the call the cache holds positions ``[0, cached_len)`` of the inserted sequence at
    ``indices``. Where the cache already held a position with a different slot than the
    caller's, the caller's slot is listed in ``duplicates`` (whole pages): the caller must free
    those slots and, if it keeps running, repoint its page-table row to ``indices``.
    """

    handle: object
    cached_len: int
    indices: torch.Tensor
    """int32 slots the cache holds for positions ``[0, cached_len)``."""
    duplicates: torch.Tensor
    """int32 caller slots that the cache did not take (it already held those positions)."""


class BasePrefixCache(ABC):
    """Interface of a prefix cache over a paged KV pool with pages of ``page_size`` tokens."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``, rounded down to whole pages.

        Refreshes the access time of the matched prefix. Changes no sizes; it may split a
        node internally. The handle is not locked.
        """

    @abstractmethod
    def insert_prefix(
        self, token_ids: Sequence[int], indices: Sequence[int] | torch.Tensor | np.ndarray
    ) -> InsertResult:
        """Offer the page-aligned part of ``token_ids`` with the caller's slots ``indices``.

        ``indices[i]`` is the slot of ``token_ids[i]``; only ``len(token_ids)`` rounded down
        to whole pages is considered. The cache takes the slots of the positions it did not
        hold yet (they become evictable) and reports the rest that differ as duplicates.
        The inserted prefix's access time is refreshed. The returned handle is not locked.
        """

    @abstractmethod
    def lock_handle(self, handle: object) -> None:
        """Protect the handle's prefix from eviction (reference counted)."""

    @abstractmethod
    def unlock_handle(self, handle: object) -> None:
        """Undo one ``lock_handle`` of the same handle."""

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Free at least ``num_tokens`` evictable tokens (fewer only if fewer are evictable).

        Unreferenced leaves go first, least recently accessed first; a parent that becomes an
        unreferenced leaf joins the candidates. Returns the freed int32 slots (whole pages);
        the caller returns them to its free pool.
        """

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens that no locked handle protects."""

    @property
    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens on the path of at least one locked handle."""

    @property
    def size(self) -> int:
        """All cached tokens."""
        return self.evictable_size + self.protected_size

    @abstractmethod
    def all_indices(self) -> torch.Tensor:
        """Every slot the cache holds (int32, any order). O(cache size): for checks only."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Recompute the accounting from the structure; raise ``AssertionError`` on any
        inconsistency. O(cache size): for tests and idle-time checks."""
