"""The decode set: running requests, one new slot each per step, retraction under pressure."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisgl.scheduler.cache_manager import CacheManager
from minisgl.scheduler.request import Request


class DecodeManager:
    """Running requests in admission order (newest last)."""

    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache
        self.running: list[Request] = []

    def __len__(self) -> int:
        return len(self.running)

    def add(self, req: Request) -> None:
        self.running.append(req)

    def remove(self, req: Request) -> None:
        self.running.remove(req)

    def reserve(
        self, retract: Callable[[Request], None]
    ) -> tuple[list[tuple[Request, torch.Tensor]], list[Request]]:
        """Give every running request a slot for its next token.

        When the pool runs dry after eviction, the most recently admitted request is handed
        to ``retract`` (which releases its KV and requeues it) until the rest fit. Returns
        ``(slots, stuck)``; a ``stuck`` request cannot grow even alone: the pool cannot hold
        its sequence.
        """
        slots: list[tuple[Request, torch.Tensor]] = []
        stuck: list[Request] = []
        i = 0
        while i < len(self.running):
            req = self.running[i]
            loc = self.cache.allocate(req.row, 1)
            if loc is not None:
                slots.append((req, loc))
                i += 1
            elif len(self.running) == 1:
                stuck.append(self.running.pop())
            else:
                retract(self.running.pop())
        return slots, stuck
