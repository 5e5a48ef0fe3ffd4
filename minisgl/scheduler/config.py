"""Scheduler configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """How requests are batched.

    ``max_prefill_length`` is the token budget of one forward: prompts longer than it are
    computed in chunks. ``mixed`` lets a forward carry the running decodes together with
    prefill chunks; without it a decode step runs between any two prefill batches.
    """

    cache: str = "radix"
    max_running_requests: int = 64
    max_prefill_length: int = 2048
    max_queued_requests: int | None = None
    mixed: bool = True
    debug_invariant: bool = False

    def __post_init__(self) -> None:
        if self.cache not in ("radix", "naive"):
            raise ValueError(f"cache must be 'radix' or 'naive', got {self.cache!r}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_prefill_length < 1:
            raise ValueError("max_prefill_length must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
