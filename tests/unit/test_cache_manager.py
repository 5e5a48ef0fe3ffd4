"""Unit tests of CacheManager: page allocation, release into the prefix cache, eviction."""

from __future__ import annotations

import pytest
import torch

from minisgl.kvcache import make_prefix_cache
from minisgl.scheduler.cache_manager import CacheManager, CacheStats


def manager(num_pages: int, page_size: int, cache: str = "radix", rows: int = 4, max_len: int = 64):
    return CacheManager(num_pages, page_size, rows, max_len, make_prefix_cache(cache, page_size))


def admit(cm: CacheManager, row: int, tokens: list[int]) -> int:
    match = cm.match_prefix(tokens[:-1])
    cm.admit(row, match)
    return match.cached_len


def run(cm: CacheManager, row: int, tokens: list[int]) -> torch.Tensor:
    """Admit ``tokens`` (leaving one to compute) and allocate the rest of them."""
    cached = admit(cm, row, tokens)
    loc = cm.allocate(row, len(tokens) - cached)
    assert loc is not None
    cm.check_invariant()
    return loc


def row_slots(cm: CacheManager, row: int) -> list[int]:
    return cm.page_table[row, : cm.device_len(row)].tolist()


def test_allocate_fills_the_partial_page_then_whole_pages() -> None:
    cm = manager(8, 4)
    cm.admit(0, cm.match_prefix([]))
    a = cm.allocate(0, 3)
    assert a is not None and a.dtype == torch.int64 and len(a) == 3
    assert cm.stats().private == 4 and cm.num_free_pages == 7
    b = cm.allocate(0, 2)
    assert b is not None
    assert b[0] == a[2] + 1
    assert int(b[1]) % 4 == 0 and int(b[1]) // 4 != int(a[0]) // 4
    c = cm.allocate(0, 1)
    assert c is not None and c[0] == b[1] + 1
    assert row_slots(cm, 0) == a.tolist() + b.tolist() + c.tolist()
    assert cm.device_len(0) == 6 and cm.stats().private == 8
    cm.check_invariant()
    assert cm.allocate(0, 0) is not None and cm.device_len(0) == 6


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_slots_are_laid_out_by_page(page_size: int) -> None:
    cm = manager(10, page_size, max_len=10 * page_size)
    cm.admit(0, cm.match_prefix([]))
    total = 0
    for n in (1, page_size + 3, 1, 2 * page_size - 1, 1):
        assert cm.allocate(0, n) is not None
        total += n
    slots = cm.page_table[0, :total]
    starts = slots[::page_size]
    assert bool((starts % page_size == 0).all())
    pos = torch.arange(total)
    assert torch.equal(slots, starts[pos // page_size] + pos % page_size)
    assert cm.stats().private == -(-total // page_size) * page_size
    cm.check_invariant()


def test_allocate_returns_none_and_changes_nothing_when_full() -> None:
    cm = manager(4, 2)
    cm.admit(0, cm.match_prefix([]))
    assert cm.allocate(0, 5) is not None
    before = (cm.stats(), cm.page_table.clone(), cm.device_len(0))
    assert not cm.can_allocate(0, 4)
    assert cm.allocate(0, 4) is None
    assert (cm.stats(), cm.device_len(0)) == (before[0], before[2])
    assert torch.equal(cm.page_table, before[1])
    assert cm.can_allocate(0, 3) and cm.allocate(0, 3) is not None
    assert cm.allocate(0, 1) is None
    cm.check_invariant()


def test_stats_and_available_tokens() -> None:
    cm = manager(8, 4)
    assert cm.stats() == CacheStats(total=32, free=32, evictable=0, protected=0, private=0)
    run(cm, 0, list(range(10)))
    cm.release(0, list(range(10)))
    assert cm.stats() == CacheStats(total=32, free=24, evictable=8, protected=0, private=0)
    assert cm.available_tokens() == 32 and cm.num_free_pages == 6
    run(cm, 1, list(range(13)))
    s = cm.stats()
    assert (s.protected, s.evictable, s.private) == (8, 0, 8)
    assert s.free + s.evictable + s.protected + s.private == s.total


def test_release_inserts_aligned_part_and_frees_the_partial_page() -> None:
    cm = manager(8, 4)
    tokens = list(range(10))
    loc = run(cm, 0, tokens)
    cm.release(0, tokens)
    s = cm.stats()
    assert (s.evictable, s.protected, s.private, s.free) == (8, 0, 0, 24)
    match = cm.match_prefix(tokens)
    assert match.cached_len == 8 and match.indices.tolist() == loc[:8].tolist()
    cm.check_invariant()


def test_release_keeps_the_cached_prefix_and_frees_duplicates() -> None:
    cm = manager(16, 2)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    run(cm, 0, prompt)
    run(cm, 1, prompt)
    first = row_slots(cm, 0)
    cm.release(0, prompt)
    assert cm.stats().evictable == 6
    cm.release(1, prompt)
    s = cm.stats()
    assert (s.evictable, s.private, s.free) == (6, 0, 32 - 6)
    assert cm.match_prefix(prompt).indices.tolist() == first[:6]
    cm.check_invariant()

    cached = admit(cm, 2, prompt + [12, 13])
    assert cached == 6
    assert cm.allocate(2, 3) is not None
    cm.release(2, prompt + [12, 13])
    assert cm.match_prefix(prompt + [12, 13]).indices.tolist()[:6] == first[:6]
    assert cm.stats().evictable == 8
    cm.check_invariant()


def test_cache_prefix_repoints_a_running_row() -> None:
    cm = manager(16, 2)
    prompt = [1, 2, 3, 4, 5]
    run(cm, 0, prompt)
    run(cm, 1, prompt)
    cm.release(0, prompt)
    tree_slots = cm.match_prefix(prompt).indices.tolist()
    own = row_slots(cm, 1)
    assert own[:4] != tree_slots
    free_before = cm.num_free_pages
    assert cm.cache_prefix(1, prompt) == 4
    assert row_slots(cm, 1)[:4] == tree_slots
    assert row_slots(cm, 1)[4] == own[4]
    assert cm.num_free_pages == free_before + 2
    assert cm.cached_len(1) == 4
    s = cm.stats()
    assert (s.protected, s.evictable, s.private) == (4, 0, 2)
    assert cm.allocate(1, 1) is not None and row_slots(cm, 1)[5] == own[4] + 1
    cm.check_invariant()
    cm.release(1, prompt + [6])
    assert cm.stats().evictable == 6 and cm.stats().private == 0
    cm.check_invariant()


def test_cache_prefix_twice_keeps_own_pages() -> None:
    cm = manager(16, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    run(cm, 0, tokens)
    assert cm.cache_prefix(0, tokens) == 6
    assert cm.allocate(0, 2) is not None
    assert cm.cache_prefix(0, tokens + [7, 8]) == 8
    s = cm.stats()
    assert (s.protected, s.evictable, s.private) == (8, 0, 0)
    cm.check_invariant()
    cm.release(0, tokens + [7, 8])
    assert cm.stats().evictable == 8
    cm.check_invariant()


def test_release_without_tokens_frees_private_pages_only() -> None:
    cm = manager(8, 2)
    run(cm, 0, [1, 2, 3, 4, 5])
    cm.release(0, [1, 2, 3, 4, 5])
    run(cm, 1, [1, 2, 3, 4, 5, 6, 7])
    assert cm.cached_len(1) == 4
    cm.release(1, None)
    s = cm.stats()
    assert (s.evictable, s.protected, s.private, s.free) == (4, 0, 0, 12)
    assert cm.match_prefix([1, 2, 3, 4, 5]).cached_len == 4
    cm.check_invariant()


def test_allocate_evicts_on_demand_but_never_the_admitted_prefix() -> None:
    cm = manager(6, 2)
    run(cm, 0, [1, 2, 3, 4, 5])
    cm.release(0, [1, 2, 3, 4, 5])
    run(cm, 0, [9, 9, 9, 9, 9])
    cm.release(0, [9, 9, 9, 9, 9])
    assert cm.stats().evictable == 8 and cm.num_free_pages == 2
    assert admit(cm, 1, [1, 2, 3, 4, 7]) == 4
    assert cm.available_tokens() == 8
    assert cm.allocate(1, 5) is not None
    assert cm.match_prefix([9, 9, 9, 9]).cached_len == 0
    s = cm.stats()
    assert (s.protected, s.evictable, s.private, s.free) == (4, 0, 6, 2)
    assert cm.allocate(1, 1) is not None and cm.num_free_pages == 1
    assert cm.allocate(1, 3) is None
    assert cm.allocate(1, 2) is not None and cm.num_free_pages == 0
    assert cm.match_prefix([1, 2, 3, 4]).cached_len == 4
    cm.check_invariant()


def test_evict_reports_freed_tokens() -> None:
    cm = manager(8, 2)
    run(cm, 0, [1, 2, 3, 4, 5])
    cm.release(0, [1, 2, 3, 4, 5])
    assert cm.evict(1) == 4 and cm.num_free_pages == 8
    assert cm.evict(10) == 0
    cm.check_invariant()


def test_naive_release_frees_everything() -> None:
    cm = manager(8, 2, cache="naive")
    run(cm, 0, [1, 2, 3, 4, 5])
    assert cm.cache_prefix(0, [1, 2, 3, 4, 5]) == 0
    cm.release(0, [1, 2, 3, 4, 5])
    assert cm.stats() == CacheStats(total=16, free=16, evictable=0, protected=0, private=0)
    assert admit(cm, 0, [1, 2, 3, 4, 5]) == 0
    cm.check_invariant()


def test_misuse_raises() -> None:
    cm = manager(8, 2, max_len=8)
    with pytest.raises(ValueError):
        cm.allocate(0, 1)
    cm.admit(0, cm.match_prefix([]))
    with pytest.raises(ValueError):
        cm.admit(0, cm.match_prefix([]))
    with pytest.raises(ValueError):
        cm.allocate(0, 9)
    assert cm.allocate(0, 3) is not None
    with pytest.raises(ValueError):
        cm.release(0, [1, 2])
    with pytest.raises(ValueError):
        CacheManager(8, 2, 1, 8, make_prefix_cache("radix", 4))


def test_check_invariant_detects_a_row_reading_a_free_page() -> None:
    cm = manager(8, 2)
    run(cm, 0, [1, 2, 3, 4, 5])
    cm.check_invariant()
    free_page = int(cm._free[0])
    cm.page_table[0, 2:4] = torch.tensor([free_page * 2, free_page * 2 + 1])
    with pytest.raises(AssertionError, match="two places"):
        cm.check_invariant()


def test_check_invariant_detects_a_leaked_page() -> None:
    cm = manager(8, 2)
    run(cm, 0, [1, 2, 3, 4, 5])
    cm._num_free -= 1
    with pytest.raises(AssertionError, match="total"):
        cm.check_invariant()
    cm._num_free += 1
    cm._private_pages -= 1
    cm._num_free += 1
    with pytest.raises(AssertionError):
        cm.check_invariant()
