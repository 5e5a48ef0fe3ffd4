"""A prefix cache that shares nothing: the ablation baseline (``--cache naive``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from minisgl.kvcache.base import EMPTY_INDICES, BasePrefixCache, InsertResult, PrefixMatch


class NaivePrefixCache(BasePrefixCache):
    """Matches nothing and keeps nothing: every insert leaves all slots with the caller."""

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self._num_locks = 0

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        return PrefixMatch(handle=None, cached_len=0, indices=EMPTY_INDICES)

    def insert_prefix(
        self, token_ids: Sequence[int], indices: Sequence[int] | torch.Tensor | np.ndarray
    ) -> InsertResult:
        return InsertResult(
            handle=None, cached_len=0, indices=EMPTY_INDICES, duplicates=EMPTY_INDICES
        )

    def lock_handle(self, handle: object) -> None:
        if handle is not None:
            raise ValueError("NaivePrefixCache only hands out the handle None")
        self._num_locks += 1

    def unlock_handle(self, handle: object) -> None:
        if handle is not None:
            raise ValueError("NaivePrefixCache only hands out the handle None")
        if self._num_locks == 0:
            raise ValueError("unlock_handle without a matching lock_handle")
        self._num_locks -= 1

    def evict(self, num_tokens: int) -> torch.Tensor:
        return EMPTY_INDICES

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0

    def all_indices(self) -> torch.Tensor:
        return EMPTY_INDICES

    def check_integrity(self) -> None:
        if self._num_locks < 0:
            raise AssertionError(f"negative lock count {self._num_locks}")
