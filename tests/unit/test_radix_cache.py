"""Unit tests of the prefix caches: each operation of the contract, on both implementations."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from minisgl.kvcache import (
    BasePrefixCache,
    NaivePrefixCache,
    RadixPrefixCache,
    make_prefix_cache,
    prefix_cache_names,
)


def slots_for(pages: list[int], page_size: int) -> list[int]:
    return [p * page_size + j for p in pages for j in range(page_size)]


def as_list(t: torch.Tensor) -> list[int]:
    return t.tolist()


# ---- the seed's examples ----------------------------------------------------------------


def test_seed_tree_shape() -> None:
    cache = RadixPrefixCache(page_size=1)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 8], [1, 2, 9]):
        cache.insert_prefix(seq, [100 + t for t in seq])
    assert cache.tree() == {(1, 2): {(3,): {(4,): {}, (8,): {}}, (9,): {}}}
    cache.check_integrity()
    assert cache.evictable_size == 6 and cache.protected_size == 0


def test_split_at_keeps_handles_and_slots() -> None:
    cache = RadixPrefixCache(page_size=1)
    inserted = cache.insert_prefix([3, 4, 5, 6], [30, 40, 50, 60])
    match = cache.match_prefix([3, 4, 7])
    assert match.cached_len == 2 and as_list(match.indices) == [30, 40]
    assert cache.tree() == {(3, 4): {(5, 6): {}}}
    cache.lock_handle(inserted.handle)
    assert cache.protected_size == 4 and cache.evictable_size == 0
    full = cache.match_prefix([3, 4, 5, 6, 9])
    assert full.handle is inserted.handle and as_list(full.indices) == [30, 40, 50, 60]
    cache.unlock_handle(inserted.handle)
    cache.check_integrity()


def test_split_of_a_locked_node_keeps_accounting() -> None:
    cache = RadixPrefixCache(1)
    h = cache.insert_prefix([3, 4, 5, 6], [30, 40, 50, 60]).handle
    cache.lock_handle(h)
    cache.insert_prefix([3, 4, 7], [30, 40, 70])
    assert (cache.protected_size, cache.evictable_size) == (4, 1)
    cache.check_integrity()
    cache.unlock_handle(h)
    assert (cache.protected_size, cache.evictable_size) == (0, 5)
    cache.check_integrity()


# ---- match --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["radix", "naive"])
def test_empty_cache_matches_nothing(name: str) -> None:
    cache = make_prefix_cache(name, 4)
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.cached_len == 0 and m.indices.numel() == 0
    cache.lock_handle(m.handle)
    cache.unlock_handle(m.handle)
    cache.check_integrity()


def test_match_rounds_down_to_whole_pages() -> None:
    ps = 4
    cache = RadixPrefixCache(ps)
    seq = list(range(12))
    cache.insert_prefix(seq, slots_for([5, 2, 7], ps))
    assert cache.match_prefix(seq[:11]).cached_len == 8
    mid_page = seq[:6] + [99] + seq[7:]
    m = cache.match_prefix(mid_page)
    assert m.cached_len == 4 and as_list(m.indices) == slots_for([5], ps)
    assert cache.tree() == {(0, 1, 2, 3): {(4, 5, 6, 7): {(8, 9, 10, 11): {}}}}
    assert cache.match_prefix(seq[:3]).cached_len == 0
    assert cache.match_prefix([0, 1, 2, 9]).cached_len == 0
    cache.check_integrity()


def test_match_walks_several_nodes() -> None:
    cache = RadixPrefixCache(1)
    cache.insert_prefix([1, 2, 3, 4], [10, 20, 30, 40])
    cache.insert_prefix([1, 2, 5, 6], [10, 20, 50, 60])
    cache.insert_prefix([1, 2, 5, 6, 7, 8], [10, 20, 50, 60, 70, 80])
    m = cache.match_prefix([1, 2, 5, 6, 7, 9])
    assert m.cached_len == 5 and as_list(m.indices) == [10, 20, 50, 60, 70]
    assert cache.size == 8
    cache.check_integrity()


# ---- insert ----------------------------------------------------------------------------


def test_insert_reports_duplicates_and_cached_slots() -> None:
    ps = 2
    cache = RadixPrefixCache(ps)
    first = cache.insert_prefix([1, 2, 3, 4], slots_for([0, 1], ps))
    assert first.duplicates.numel() == 0 and first.cached_len == 4
    second = cache.insert_prefix([1, 2, 3, 4, 5, 6, 7], slots_for([8, 9, 3], ps) + [99])
    assert second.cached_len == 6
    assert as_list(second.duplicates) == slots_for([8, 9], ps)
    assert as_list(second.indices) == slots_for([0, 1, 3], ps)
    assert cache.size == 6
    cache.check_integrity()


def test_insert_of_own_slots_is_not_a_duplicate() -> None:
    cache = RadixPrefixCache(1)
    cache.insert_prefix([1, 2, 3], [7, 8, 9])
    again = cache.insert_prefix([1, 2, 3, 4], [7, 8, 9, 10])
    assert again.duplicates.numel() == 0
    assert as_list(again.indices) == [7, 8, 9, 10]
    cache.check_integrity()


def test_insert_does_not_alias_the_callers_tensor() -> None:
    cache = RadixPrefixCache(1)
    row = torch.tensor([4, 5, 6], dtype=torch.int32)
    cache.insert_prefix([1, 2, 3], row)
    row[:] = -1
    assert as_list(cache.match_prefix([1, 2, 3]).indices) == [4, 5, 6]


def test_insert_ignores_partial_last_page_and_checks_length() -> None:
    cache = RadixPrefixCache(4)
    res = cache.insert_prefix(list(range(7)), list(range(7)))
    assert res.cached_len == 4 and cache.size == 4
    with pytest.raises(ValueError):
        cache.insert_prefix(list(range(8)), list(range(5)))


def test_insert_splits_inside_a_node_at_a_page_boundary() -> None:
    ps = 2
    cache = RadixPrefixCache(ps)
    cache.insert_prefix([1, 2, 3, 4, 5, 6], slots_for([0, 1, 2], ps))
    res = cache.insert_prefix([1, 2, 3, 9, 5, 6], slots_for([3, 4, 5], ps))
    assert cache.tree() == {(1, 2): {(3, 4, 5, 6): {}, (3, 9, 5, 6): {}}}
    assert as_list(res.duplicates) == slots_for([3], ps)
    assert as_list(res.indices) == slots_for([0, 4, 5], ps)
    cache.check_integrity()


# ---- lock / unlock ------------------------------------------------------------------------


def test_lock_moves_sizes_on_zero_one_transitions() -> None:
    cache = RadixPrefixCache(1)
    a = cache.insert_prefix([1, 2, 3, 4], [1, 2, 3, 4]).handle
    b = cache.insert_prefix([1, 2, 5], [1, 2, 5]).handle
    assert (cache.evictable_size, cache.protected_size) == (5, 0)
    cache.lock_handle(a)
    assert (cache.evictable_size, cache.protected_size) == (1, 4)
    cache.lock_handle(b)
    assert (cache.evictable_size, cache.protected_size) == (0, 5)
    cache.lock_handle(a)
    assert (cache.evictable_size, cache.protected_size) == (0, 5)
    cache.unlock_handle(a)
    cache.unlock_handle(b)
    assert (cache.evictable_size, cache.protected_size) == (1, 4)
    cache.check_integrity()
    cache.unlock_handle(a)
    assert (cache.evictable_size, cache.protected_size) == (5, 0)
    with pytest.raises(ValueError):
        cache.unlock_handle(a)
    cache.check_integrity()


def test_stale_handle_is_refused() -> None:
    cache = RadixPrefixCache(1)
    m = cache.insert_prefix([1, 2], [0, 1])
    cache.evict(2)
    with pytest.raises(ValueError, match="stale"):
        cache.lock_handle(m.handle)
    with pytest.raises(TypeError):
        cache.lock_handle("not a handle")


# ---- evict ----------------------------------------------------------------------------------


def test_evict_is_lru_among_unreferenced_leaves() -> None:
    cache = RadixPrefixCache(1)
    cache.insert_prefix([1, 2, 3], [1, 2, 3])
    cache.insert_prefix([1, 2, 4], [1, 2, 4])
    cache.insert_prefix([5, 6], [5, 6])
    cache.match_prefix([1, 2, 3])
    assert as_list(cache.evict(1)) == [4]
    assert as_list(cache.evict(1)) == [5, 6]
    assert as_list(cache.evict(2)) == [3, 1, 2]
    assert cache.size == 0 and cache.evict(1).numel() == 0
    cache.check_integrity()


def test_evict_cascades_and_frees_at_least_n() -> None:
    cache = RadixPrefixCache(1)
    cache.insert_prefix([1, 2, 3, 4], [1, 2, 3, 4])
    cache.insert_prefix([1, 2, 5], [1, 2, 5])
    cache.match_prefix([1, 2, 5])
    freed = cache.evict(2)
    assert as_list(freed) == [3, 4]
    freed = cache.evict(2)
    assert sorted(as_list(freed)) == [1, 2, 5]
    cache.check_integrity()


def test_locked_path_is_never_evicted() -> None:
    cache = RadixPrefixCache(1)
    keep = cache.insert_prefix([1, 2, 3], [1, 2, 3]).handle
    cache.insert_prefix([1, 2, 7, 8], [1, 2, 7, 8])
    cache.insert_prefix([9], [9])
    cache.lock_handle(keep)
    freed = cache.evict(100)
    assert sorted(as_list(freed)) == [7, 8, 9]
    assert cache.protected_size == 3 and cache.evictable_size == 0
    assert cache.match_prefix([1, 2, 3]).cached_len == 3
    cache.unlock_handle(keep)
    assert as_list(cache.evict(1)) == [3]
    assert sorted(as_list(cache.evict(1))) == [1, 2]
    cache.check_integrity()


def test_touching_a_leaf_after_push_reorders_eviction() -> None:
    cache = RadixPrefixCache(1)
    for k in range(5):
        cache.insert_prefix([k, 100], [2 * k, 2 * k + 1])
    cache.match_prefix([0, 100])
    cache.match_prefix([1, 100])
    order = [as_list(cache.evict(1)) for _ in range(5)]
    assert order == [[4, 5], [6, 7], [8, 9], [0, 1], [2, 3]]


def test_unlocked_leaf_becomes_evictable_again() -> None:
    cache = RadixPrefixCache(1)
    h = cache.insert_prefix([1, 2], [1, 2]).handle
    cache.lock_handle(h)
    assert cache.evict(10).numel() == 0
    cache.unlock_handle(h)
    assert sorted(as_list(cache.evict(10))) == [1, 2]
    cache.check_integrity()


# ---- integrity checks really check ------------------------------------------------------


def test_check_integrity_detects_corruption() -> None:
    cache = RadixPrefixCache(1)
    cache.insert_prefix([1, 2, 3], [1, 2, 3])
    cache.insert_prefix([1, 2, 4], [1, 2, 5])
    cache.check_integrity()
    cache._evictable += 1
    with pytest.raises(AssertionError, match="evictable"):
        cache.check_integrity()
    cache._evictable -= 1
    leaf = cache._root.children[1].children[4]
    leaf.value = np.array([3], dtype=np.int32)
    with pytest.raises(AssertionError, match="two places"):
        cache.check_integrity()
    leaf.value = np.array([5], dtype=np.int32)
    leaf.ref = 1
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_check_integrity_detects_split_pages() -> None:
    cache = RadixPrefixCache(2)
    cache.insert_prefix([1, 2], [4, 6])
    with pytest.raises(AssertionError, match="whole"):
        cache.check_integrity()


# ---- page sizes against a brute-force reference -----------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_random_match_insert_against_brute_force(page_size: int) -> None:
    rng = random.Random(page_size)
    cache = RadixPrefixCache(page_size)
    held: dict[tuple[int, ...], int] = {}
    next_page = 0
    bases = [[rng.randrange(3) for _ in range(rng.randrange(1, 6) * page_size)] for _ in range(4)]
    for _ in range(150):
        seq = list(rng.choice(bases))
        cut = rng.randrange(len(seq) + 1)
        seq = seq[:cut] + [rng.randrange(3) for _ in range(rng.randrange(3 * page_size))]
        expect = 0
        while expect + page_size <= len(seq) and tuple(seq[: expect + page_size]) in held:
            expect += page_size
        m = cache.match_prefix(seq)
        assert m.cached_len == expect
        want = [held[tuple(seq[: k + page_size])] for k in range(0, expect, page_size)]
        assert as_list(m.indices) == slots_for(want, page_size)
        pages = list(range(next_page, next_page + len(seq) // page_size))
        next_page += len(pages)
        res = cache.insert_prefix(seq, slots_for(pages, page_size))
        aligned = len(seq) // page_size * page_size
        assert res.cached_len == aligned
        dups = []
        for i, k in enumerate(range(page_size, aligned + 1, page_size)):
            key = tuple(seq[:k])
            if key in held:
                dups.append(pages[i])
            else:
                held[key] = pages[i]
        assert as_list(res.duplicates) == slots_for(dups, page_size)
        assert cache.size == len(held) * page_size
    cache.check_integrity()


# ---- naive and the registry ----------------------------------------------------------------


def test_naive_keeps_nothing() -> None:
    cache = NaivePrefixCache(4)
    res = cache.insert_prefix(list(range(8)), list(range(8)))
    assert res.cached_len == 0 and res.duplicates.numel() == 0 and res.indices.numel() == 0
    assert cache.match_prefix(list(range(8))).cached_len == 0
    assert cache.size == 0 and cache.evict(4).numel() == 0
    cache.lock_handle(None)
    with pytest.raises(ValueError):
        cache.lock_handle(object())
    cache.unlock_handle(None)
    with pytest.raises(ValueError):
        cache.unlock_handle(None)


def test_registry() -> None:
    assert prefix_cache_names() == ["naive", "radix"]
    for name, cls in (("radix", RadixPrefixCache), ("naive", NaivePrefixCache)):
        cache = make_prefix_cache(name, 16)
        assert isinstance(cache, cls) and isinstance(cache, BasePrefixCache)
        assert cache.page_size == 16
    with pytest.raises(ValueError, match="unknown prefix cache"):
        make_prefix_cache("lru", 1)
    with pytest.raises(ValueError):
        make_prefix_cache("radix", 0)
