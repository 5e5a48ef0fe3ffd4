"""Who owns which KV page: the free pool, the page table and the prefix cache.

Each table row (one admitted request) reads its slots from ``page_table[row]``::

    position  0 ............ cached_len ................... device_len ...... max_seq_len
              | prefix cache's |  private pages of the row    |
              | pages (locked) |  (the last may be partial)   |
              ^ page aligned

Page ``p`` is slots ``[p * page_size, (p + 1) * page_size)``; a row's positions fill its pages
in order, so ``page_table[row, pos] == page * page_size + pos % page_size``. Every page is in
exactly one place: the free pool, the prefix cache (evictable or protected), or private to
one row. In tokens: ``free + evictable + protected + private == total``.

All bookkeeping is on the host; nothing here touches the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from minisgl.kvcache.base import BasePrefixCache, InsertResult, PrefixMatch


@dataclass(frozen=True)
class CacheStats:
    """Token counts (page granular); ``free + evictable + protected + private == total``."""

    total: int
    free: int
    evictable: int
    protected: int
    private: int


class CacheManager:
    """Free-page pool, page table and per-row ownership over a prefix cache.

    Typical use by the scheduler::

        match = cm.match_prefix(tokens[:-1])   # leave a token to compute
        cm.admit(row, match)                   # locks the matched prefix
        loc = cm.allocate(row, n)              # None: does not fit even after eviction
        ...
        cm.release(row, tokens[:cm.device_len(row)])

    A match is only valid until something evicts (an ``allocate`` for another row): admit it
    first. Before ``admit`` the matched prefix still counts as evictable in
    ``available_tokens()``; after it, ``can_allocate`` gives the exact answer.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_rows: int,
        max_seq_len: int,
        prefix_cache: BasePrefixCache,
    ) -> None:
        if num_pages < 1 or page_size < 1 or num_rows < 1 or max_seq_len < 1:
            raise ValueError("num_pages, page_size, num_rows and max_seq_len must be >= 1")
        if prefix_cache.page_size != page_size:
            raise ValueError(
                f"prefix cache page_size {prefix_cache.page_size} != manager's {page_size}"
            )
        if num_pages * page_size > 2**31 - 1:
            raise ValueError("slot indices must fit in int32")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_rows = num_rows
        self.max_seq_len = max_seq_len
        self.prefix_cache = prefix_cache
        self.page_table = torch.zeros((num_rows, max_seq_len), dtype=torch.int32)
        self._table = self.page_table.numpy()
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._num_free = num_pages
        self._private_pages = 0
        self._active = [False] * num_rows
        self._handle: list[object] = [None] * num_rows
        self._cached = [0] * num_rows
        self._device = [0] * num_rows
        self._offsets = np.arange(page_size, dtype=np.int64)

    # ---- queries -----------------------------------------------------------------------
    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    def available_tokens(self) -> int:
        """Tokens obtainable for new pages: free plus evictable."""
        return self._num_free * self.page_size + self.prefix_cache.evictable_size

    def device_len(self, row: int) -> int:
        """Positions of the row that have a slot."""
        return self._device[row]

    def cached_len(self, row: int) -> int:
        """Leading positions of the row whose pages the prefix cache holds."""
        return self._cached[row]

    def is_active(self, row: int) -> bool:
        return self._active[row]

    def pages_needed(self, row: int, num_tokens: int) -> int:
        """New pages that ``allocate(row, num_tokens)`` would take."""
        d = self._device[row]
        ps = self.page_size
        return -(-(d + num_tokens) // ps) - -(-d // ps)

    def can_allocate(self, row: int, num_tokens: int) -> bool:
        """Whether ``allocate(row, num_tokens)`` would succeed (evicting if needed)."""
        need = self.pages_needed(row, num_tokens)
        return need <= self._num_free + self.prefix_cache.evictable_size // self.page_size

    def stats(self) -> CacheStats:
        ps = self.page_size
        return CacheStats(
            total=self.num_pages * ps,
            free=self._num_free * ps,
            evictable=self.prefix_cache.evictable_size,
            protected=self.prefix_cache.protected_size,
            private=self._private_pages * ps,
        )

    # ---- request lifecycle -------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached page-aligned prefix; pass it to ``admit`` before anything evicts."""
        return self.prefix_cache.match_prefix(token_ids)

    def admit(self, row: int, match: PrefixMatch) -> None:
        """Start ``row`` on ``match``: lock its prefix and point the row at its slots."""
        if self._active[row]:
            raise ValueError(f"row {row} is already in use")
        if match.cached_len > self.max_seq_len:
            raise ValueError(f"cached_len {match.cached_len} > max_seq_len {self.max_seq_len}")
        self.prefix_cache.lock_handle(match.handle)
        if match.cached_len:
            self._table[row, : match.cached_len] = match.indices.numpy()
        self._active[row] = True
        self._handle[row] = match.handle
        self._cached[row] = match.cached_len
        self._device[row] = match.cached_len

    def allocate(self, row: int, num_tokens: int) -> torch.Tensor | None:
        """Slots (int64) for the row's next ``num_tokens`` positions, written into the page
        table. Fills the row's partly filled last page first, then takes whole pages,
        evicting from the prefix cache when the free pool runs short. Returns None and
        changes nothing when the pages cannot be found."""
        self._require_active(row)
        d = self._device[row]
        end = d + num_tokens
        if num_tokens < 0 or end > self.max_seq_len:
            raise ValueError(f"row {row}: cannot grow {d} by {num_tokens} (max {self.max_seq_len})")
        if num_tokens == 1:
            return self._allocate_one(row, d)
        ps = self.page_size
        boundary = -(-d // ps) * ps
        need = -(-end // ps) - boundary // ps
        if need > self._num_free and not self._reclaim(need - self._num_free):
            return None
        parts: list[np.ndarray] = []
        lead = min(boundary, end) - d
        if lead > 0:
            start = int(self._table[row, d - 1]) + 1
            parts.append(np.arange(start, start + lead, dtype=np.int64))
        if need:
            pages = self._pop(need).astype(np.int64)
            parts.append((pages[:, None] * ps + self._offsets).reshape(-1)[: end - boundary])
        out = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        self._table[row, d:end] = out
        self._device[row] = end
        self._private_pages += need
        return torch.from_numpy(out)

    def _allocate_one(self, row: int, d: int) -> torch.Tensor | None:
        ps = self.page_size
        if d % ps:
            slot = int(self._table[row, d - 1]) + 1
        else:
            if self._num_free == 0 and not self._reclaim(1):
                return None
            self._num_free -= 1
            slot = int(self._free[self._num_free]) * ps
            self._private_pages += 1
        self._table[row, d] = slot
        self._device[row] = d + 1
        return torch.from_numpy(np.array([slot], dtype=np.int64))

    def cache_prefix(self, row: int, token_ids: Sequence[int]) -> int:
        """Insert the row's computed page-aligned prefix into the prefix cache while the row
        keeps running: its duplicate pages are freed, its page-table row is repointed to the
        cached slots, and the lock moves to the longer prefix. ``token_ids`` are the tokens
        whose KV is in the pool (``len == device_len``). Returns the new ``cached_len``."""
        self._require_active(row)
        old = self._handle[row]
        res = self._insert(row, token_ids)
        self.prefix_cache.lock_handle(res.handle)
        self.prefix_cache.unlock_handle(old)
        self._handle[row] = res.handle
        self._cached[row] = res.cached_len
        return res.cached_len

    def release(self, row: int, token_ids: Sequence[int] | None) -> None:
        """End the row. With ``token_ids`` (the tokens whose KV is in the pool, ``len ==
        device_len``) the page-aligned part goes into the prefix cache, duplicates freed;
        the remaining private pages (including a partial last page) are freed and the
        matched prefix is unlocked. With None nothing is inserted."""
        self._require_active(row)
        cached = self._cached[row]
        if token_ids is not None:
            cached = self._insert(row, token_ids).cached_len
        self._free_positions(row, cached, self._device[row])
        self.prefix_cache.unlock_handle(self._handle[row])
        self._active[row] = False
        self._handle[row] = None
        self._cached[row] = 0
        self._device[row] = 0

    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` from the prefix cache into the free pool (fewer if
        fewer are evictable). Returns the tokens freed."""
        freed = self.prefix_cache.evict(num_tokens).numpy()
        self._push(freed[:: self.page_size] // self.page_size)
        return freed.size

    # ---- internals ---------------------------------------------------------------------
    def _insert(self, row: int, token_ids: Sequence[int]) -> InsertResult:
        d = self._device[row]
        if len(token_ids) != d:
            raise ValueError(f"row {row}: {len(token_ids)} token ids for device_len {d}")
        ps = self.page_size
        cached = self._cached[row]
        aligned = d - d % ps
        res = self.prefix_cache.insert_prefix(token_ids[:aligned], self._table[row, :aligned])
        new_len = res.cached_len
        if new_len < cached:
            raise AssertionError(
                f"row {row}: insert kept {new_len} tokens, less than the locked {cached}"
            )
        dup = res.duplicates.numpy()
        if dup.size:
            if dup.size % ps:
                raise AssertionError(f"row {row}: {dup.size} duplicate slots, not whole pages")
            self._push(dup[::ps] // ps)
        if new_len > cached:
            self._table[row, cached:new_len] = res.indices.numpy()[cached:new_len]
            self._private_pages -= (new_len - cached) // ps
        return res

    def _free_positions(self, row: int, start: int, end: int) -> None:
        if end > start:
            pages = self._table[row, start : end : self.page_size] // self.page_size
            self._push(pages)
            self._private_pages -= pages.size

    def _reclaim(self, short_pages: int) -> bool:
        ps = self.page_size
        if self.prefix_cache.evictable_size // ps < short_pages:
            return False
        self.evict(short_pages * ps)
        return True

    def _pop(self, k: int) -> np.ndarray:
        n = self._num_free
        self._num_free = n - k
        return self._free[n - k : n]

    def _push(self, pages: np.ndarray) -> None:
        k = pages.size
        if not k:
            return
        n = self._num_free
        if n + k > self.num_pages:
            raise AssertionError(f"freeing {k} pages into a pool with {n} of {self.num_pages} free")
        self._free[n : n + k] = pages
        self._num_free = n + k

    def _require_active(self, row: int) -> None:
        if not self._active[row]:
            raise ValueError(f"row {row} is not admitted")

    # ---- invariant ---------------------------------------------------------------------
    def free_pages(self) -> torch.Tensor:
        """The free pool's page indices (a copy), for checks."""
        return torch.from_numpy(self._free[: self._num_free].copy())

    def check_invariant(self) -> None:
        """Check that every page is in exactly one place and the counters agree.

        Raises AssertionError with the details. O(pages + tree): for tests and idle checks.
        """
        s = self.stats()
        parts = s.free + s.evictable + s.protected + s.private
        _require(
            parts == s.total,
            f"free {s.free} + evictable {s.evictable} + protected {s.protected} + "
            f"private {s.private} = {parts} != total {s.total}",
        )
        self.prefix_cache.check_integrity()
        ps = self.page_size
        tree = self.prefix_cache.all_indices().numpy().astype(np.int64)
        _require(tree.size == s.evictable + s.protected, "prefix cache size != its slots")
        tree_pages = tree[::ps] // ps
        _require(bool(((tree_pages >= 0) & (tree_pages < self.num_pages)).all()), "bad page")
        in_tree = np.zeros(self.num_pages, dtype=bool)
        in_tree[tree_pages] = True
        owned = [self._free[: self._num_free].astype(np.int64), tree_pages]
        private = 0
        for row in range(self.num_rows):
            if not self._active[row]:
                continue
            c, d = self._cached[row], self._device[row]
            slots = self._table[row, :d].astype(np.int64)
            starts = slots[::ps]
            _require(bool((starts % ps == 0).all()), f"row {row}: a page starts off-page")
            _require(
                bool(((starts >= 0) & (starts < self.num_pages * ps)).all()),
                f"row {row}: slot out of range",
            )
            expected = (starts[:, None] + self._offsets).reshape(-1)[:d]
            _require(bool((slots == expected).all()), f"row {row}: slots not laid out by page")
            shared = starts[: c // ps] // ps
            _require(bool(in_tree[shared].all()), f"row {row}: cached prefix not in the cache")
            own = starts[c // ps :] // ps
            owned.append(own)
            private += own.size
        _require(
            private == self._private_pages,
            f"rows hold {private} private pages, counter says {self._private_pages}",
        )
        count = np.bincount(np.concatenate(owned), minlength=self.num_pages)
        lost = np.flatnonzero(count == 0)[:8].tolist()
        twice = np.flatnonzero(count > 1)[:8].tolist()
        _require(not lost and not twice, f"pages lost {lost}, pages in two places {twice}")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(f"CacheManager: {message}")
