"""Prefill admission: FCFS over the waiting queue within a per-batch token budget."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from minisgl.scheduler.cache_manager import CacheManager
from minisgl.scheduler.request import Request
from minisgl.scheduler.table import TableManager


@dataclass
class Chunk:
    """One request's share of a forward: positions ``[start, end)`` written at ``out_loc``."""

    req: Request
    start: int
    end: int
    out_loc: torch.Tensor

    @property
    def samples(self) -> bool:
        return self.end == self.req.seq_len


SHARE_PROBE = 32
"""Leading uncached tokens compared to spot requests that share a prefix within one batch."""


class PrefillManager:
    """Owns the waiting queue.

    A request keeps its place at the head of the queue while its prompt is computed chunk by
    chunk; it leaves the queue when its last chunk is scheduled (it then samples and joins the
    decode set). The prefix match always leaves at least one token to compute, so every
    prefill ends in a forward that yields logits.
    """

    def __init__(self, cache: CacheManager, table: TableManager, share: bool = True) -> None:
        self.cache = cache
        self.share = share
        self.table = table
        self.waiting: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self.waiting)

    def enqueue(self, req: Request) -> None:
        self.waiting.append(req)

    def requeue(self, req: Request) -> None:
        """Put a retracted request back first in line (behind a half-prefilled head)."""
        self._partial_first()
        head_busy = bool(self.waiting) and self.waiting[0].admitted
        self.waiting.insert(1 if head_busy else 0, req)

    def remove(self, req: Request) -> None:
        self.waiting.remove(req)

    def schedule(self, budget: int) -> list[Chunk]:
        """Chunks for this forward, at most ``budget`` tokens in all.

        A fresh request whose first uncached tokens equal those of a request already in this
        batch waits one round: once the batch has run, that shared prefix is in the prefix
        cache and the waiting request computes only its own suffix.
        """
        self._partial_first()
        chunks: list[Chunk] = []
        computing: set[tuple[int, ...]] = set()
        i = 0
        while i < len(self.waiting) and budget > 0:
            req = self.waiting[i]
            fresh = not req.admitted
            if fresh:
                if not self._admit(req):
                    break
                key = tuple(req.tokens(req.cached_len, req.cached_len + SHARE_PROBE))
                if self.share and len(key) == SHARE_PROBE and req.pending_len > SHARE_PROBE:
                    if key in computing:
                        self._unadmit(req)
                        i += 1
                        continue
                    computing.add(key)
            extend = min(req.pending_len, budget)
            out_loc = self.cache.allocate(req.row, extend)
            if out_loc is None:
                if fresh:
                    self._unadmit(req)
                break
            if not req.admitted_once:
                req.admitted_once = True
                req.prompt_cached_len = min(req.cached_len, req.prompt_len)
            start = req.device_len
            req.advance(extend)
            chunks.append(Chunk(req, start, req.device_len, out_loc))
            budget -= extend
            if req.pending_len:
                break
            del self.waiting[i]
        return chunks

    def _partial_first(self) -> None:
        """A half-prefilled request (there is at most one) always continues first."""
        for i, req in enumerate(self.waiting):
            if req.admitted:
                if i:
                    del self.waiting[i]
                    self.waiting.appendleft(req)
                return

    def _admit(self, req: Request) -> bool:
        row = self.table.allocate()
        if row is None:
            return False
        match = self.cache.match_prefix(req.tokens(0, req.seq_len - 1))
        self.cache.admit(row, match)
        req.row = row
        req.cached_len = req.device_len = match.cached_len
        return True

    def _unadmit(self, req: Request) -> None:
        self.cache.release(req.row, None)
        self.table.free(req.row)
        req.reset_device()
