"""Stateful property test of CacheManager over both prefix caches.

Hypothesis drives random sequences of admit (match + lock) / allocate / cache_prefix (insert
while running) / release with or without insert (insert + unlock + free) / match / evict
against a reference model:

- a fake KV pool: whenever a slot is allocated for position ``p`` of a row, the test writes
  ``kv[slot] = tokens[:p + 1]``; every slot a row or the cache points at must still hold the
  prefix it stands for (catches rows left reading freed or reused pages);
- the set of cached page-aligned prefixes with the page of each, and a clock of when each was
  last matched or inserted. Evictions may only happen in ``evict`` and ``allocate``, never
  touch a locked prefix, and must be least-recently-used first among unreferenced leaves.

After every step: free + evictable + protected + private == total with each term equal to the
model's, every page in exactly one place, everything shared page aligned, and both
``check_invariant`` and ``check_integrity`` pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minisgl.kvcache import make_prefix_cache
from minisgl.scheduler.cache_manager import CacheManager

Prefix = tuple[int, ...]


@dataclass
class RowModel:
    tokens: list[int]
    locked: int
    """Length of the prefix this row holds locked in the cache."""


def page_patterns(ps: int) -> list[tuple[int, ...]]:
    half = ps // 2
    return [(0,) * ps, (1,) * ps, (0,) * half + (2,) * (ps - half)]


class CacheMachine(RuleBasedStateMachine):
    cache_name = "radix"
    page_size = 1
    num_pages = 20
    num_rows = 3
    max_pages = 8

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.cm = CacheManager(
            self.num_pages,
            ps,
            self.num_rows,
            self.max_pages * ps,
            make_prefix_cache(self.cache_name, ps),
        )
        self.retains = self.cache_name == "radix"
        self.kv: dict[int, Prefix] = {}
        self.cached: dict[Prefix, int] = {}
        self.touched: dict[Prefix, int] = {}
        self.clock = 0
        self.rows: dict[int, RowModel] = {}

    # ---- strategies --------------------------------------------------------------------
    @classmethod
    def sequences(cls) -> st.SearchStrategy[list[int]]:
        """Token sequences that often share prefixes (whole pages or part of a page)."""
        ps = cls.page_size
        patterns = page_patterns(ps)
        base = [x for i in range(cls.max_pages - 2) for x in patterns[(i * 2) % 3]]
        tail = st.lists(st.integers(0, 2), max_size=ps + 1)
        shared = st.builds(lambda cut, t: base[:cut] + t, st.integers(0, len(base)), tail)
        pages = st.lists(st.sampled_from(patterns), max_size=cls.max_pages - 2)
        free = st.builds(lambda p, t: [x for page in p for x in page] + t, pages, tail)
        return st.one_of(shared, shared, free)

    # ---- reference helpers -------------------------------------------------------------
    def _free_rows(self) -> list[int]:
        return [r for r in range(self.num_rows) if r not in self.rows]

    def _expected_match(self, query: list[int]) -> int:
        ps = self.page_size
        k = 0
        while k + ps <= len(query) and tuple(query[: k + ps]) in self.cached:
            k += ps
        return k

    def _touch(self, tokens: list[int], length: int) -> None:
        self.clock += 1
        for k in range(self.page_size, length + 1, self.page_size):
            self.touched[tuple(tokens[:k])] = self.clock

    def _check_match(self, query: list[int]) -> tuple[object, int]:
        ps = self.page_size
        match = self.cm.match_prefix(query)
        expect = self._expected_match(query)
        assert match.cached_len == expect
        want = [
            self.cached[tuple(query[: k + ps])] * ps + j
            for k in range(0, expect, ps)
            for j in range(ps)
        ]
        assert match.indices.tolist() == want
        for p, slot in enumerate(want):
            assert self.kv[slot] == tuple(query[: p + 1])
        self._touch(query, expect)
        return match, expect

    def _model_insert(self, row: int, tokens: list[int]) -> int:
        """Model of inserting the row's computed tokens; returns the expected cached length."""
        if not self.retains:
            return 0
        ps = self.page_size
        aligned = len(tokens) - len(tokens) % ps
        table = self.cm.page_table[row]
        for k in range(ps, aligned + 1, ps):
            self.cached.setdefault(tuple(tokens[:k]), int(table[k - ps]) // ps)
        self._touch(tokens, aligned)
        return aligned

    def _locked_prefixes(self) -> set[Prefix]:
        ps = self.page_size
        out: set[Prefix] = set()
        for r in self.rows.values():
            out.update(tuple(r.tokens[:k]) for k in range(ps, r.locked + 1, ps))
        return out

    def _observe_cache(self, may_evict: bool, min_freed: int = 0) -> None:
        """Read the cache's content through the fake KV pool, compare it with the model and
        apply (checked) evictions to the model."""
        ps = self.page_size
        slots = self.cm.prefix_cache.all_indices().tolist()
        actual: dict[Prefix, int] = {}
        for s in slots:
            if s % ps == ps - 1:
                prefix = self.kv[s]
                assert len(prefix) % ps == 0
                actual[prefix] = s // ps
        for s in slots:
            end = self.kv[(s // ps) * ps + ps - 1]
            assert self.kv[s] == end[: len(end) - ps + s % ps + 1]
        for prefix, page in actual.items():
            assert self.cached.get(prefix) == page, f"unexpected cached prefix {prefix}"
            assert len(prefix) == ps or prefix[:-ps] in actual
        evicted = [p for p in self.cached if p not in actual]
        assert may_evict or not evicted, f"evicted outside evict/allocate: {evicted}"
        locked = self._locked_prefixes()
        assert not locked.intersection(evicted), "a locked prefix was evicted"
        assert len(evicted) * ps >= min_freed
        if evicted:
            newest_evicted = max(self.touched[p] for p in evicted)
            parents = {p[:-ps] for p in actual}
            for q in actual:
                if q not in parents and q not in locked:
                    assert self.touched[q] >= newest_evicted, "eviction was not LRU"
        for p in evicted:
            del self.cached[p]
            del self.touched[p]

    # ---- rules -------------------------------------------------------------------------
    @precondition(lambda self: len(self.rows) < self.num_rows)
    @rule(pick=st.integers(0, 99), tokens=st.data(), whole=st.booleans())
    def admit(self, pick: int, tokens: st.DataObject, whole: bool) -> None:
        seq = tokens.draw(self.sequences())
        if not seq:
            seq = [0]
        row = self._free_rows()[pick % len(self._free_rows())]
        match, cached = self._check_match(seq if whole else seq[:-1])
        self.cm.admit(row, match)
        self.rows[row] = RowModel(tokens=seq, locked=cached)
        assert self.cm.device_len(row) == cached == self.cm.cached_len(row)
        self._observe_cache(may_evict=False)

    @precondition(lambda self: self.rows)
    @rule(
        pick=st.integers(0, 99),
        n=st.integers(1, 40),
        extra=st.lists(st.integers(0, 2), max_size=40),
    )
    def allocate(self, pick: int, n: int, extra: list[int]) -> None:
        ps = self.page_size
        row = sorted(self.rows)[pick % len(self.rows)]
        model = self.rows[row]
        d = self.cm.device_len(row)
        n = min(n % (2 * ps + 2) + 1, self.max_pages * ps - d)
        if n == 0:
            return
        while len(model.tokens) < d + n:
            model.tokens.append(extra.pop() if extra else 0)
        need = -(-(d + n) // ps) - -(-d // ps)
        s = self.cm.stats()
        fits = need <= s.free // ps + s.evictable // ps
        assert self.cm.can_allocate(row, n) == fits
        table = self.cm.page_table.clone()
        loc = self.cm.allocate(row, n)
        if not fits:
            assert loc is None
            assert self.cm.stats() == s and self.cm.device_len(row) == d
            assert self.cm.page_table.equal(table)
            self._observe_cache(may_evict=False)
            return
        assert loc is not None and loc.tolist() == self.cm.page_table[row, d : d + n].tolist()
        for p, slot in zip(range(d, d + n), loc.tolist(), strict=True):
            self.kv[slot] = tuple(model.tokens[: p + 1])
        short = max(0, need - s.free // ps) * ps
        self._observe_cache(may_evict=short > 0, min_freed=short)

    @precondition(lambda self: self.rows)
    @rule(pick=st.integers(0, 99))
    def prefill(self, pick: int) -> None:
        row = sorted(self.rows)[pick % len(self.rows)]
        model = self.rows[row]
        d = self.cm.device_len(row)
        n = len(model.tokens) - d
        if n <= 0:
            return
        need = -(-(d + n) // self.page_size) - -(-d // self.page_size)
        s = self.cm.stats()
        loc = self.cm.allocate(row, n)
        if loc is None:
            assert need > (s.free + s.evictable) // self.page_size
            assert self.cm.stats() == s
            self._observe_cache(may_evict=False)
            return
        for p, slot in zip(range(d, d + n), loc.tolist(), strict=True):
            self.kv[slot] = tuple(model.tokens[: p + 1])
        short = max(0, need - s.free // self.page_size) * self.page_size
        self._observe_cache(may_evict=short > 0, min_freed=short)

    @precondition(lambda self: self.rows)
    @rule(pick=st.integers(0, 99))
    def cache_prefix(self, pick: int) -> None:
        row = sorted(self.rows)[pick % len(self.rows)]
        model = self.rows[row]
        tokens = model.tokens[: self.cm.device_len(row)]
        expect = self._model_insert(row, tokens)
        assert self.cm.cache_prefix(row, tokens) == expect
        model.locked = expect
        assert self.cm.cached_len(row) == expect
        self._observe_cache(may_evict=False)

    @precondition(lambda self: self.rows)
    @rule(pick=st.integers(0, 99), insert=st.booleans())
    def release(self, pick: int, insert: bool) -> None:
        row = sorted(self.rows)[pick % len(self.rows)]
        model = self.rows.pop(row)
        tokens = model.tokens[: self.cm.device_len(row)]
        if insert:
            self._model_insert(row, tokens)
        self.cm.release(row, tokens if insert else None)
        assert not self.cm.is_active(row)
        self._observe_cache(may_evict=False)

    @rule(tokens=st.data())
    def match_only(self, tokens: st.DataObject) -> None:
        self._check_match(tokens.draw(self.sequences()))
        self._observe_cache(may_evict=False)

    @rule(pages=st.integers(0, 4), less=st.booleans())
    def evict(self, pages: int, less: bool) -> None:
        n = max(0, pages * self.page_size - less)
        evictable = self.cm.stats().evictable
        freed = self.cm.evict(n)
        assert freed >= min(n, evictable) and freed % self.page_size == 0
        self._observe_cache(may_evict=True, min_freed=min(n, evictable))

    # ---- invariants --------------------------------------------------------------------
    @invariant()
    def accounting_matches_the_model(self) -> None:
        ps = self.page_size
        s = self.cm.stats()
        assert s.free + s.evictable + s.protected + s.private == s.total
        locked = self._locked_prefixes()
        assert s.protected == len(locked) * ps
        assert s.evictable == (len(self.cached) - len(locked)) * ps
        private = sum(-(-(self.cm.device_len(r) - m.locked) // ps) for r, m in self.rows.items())
        assert s.private == private * ps
        assert s.free == self.cm.num_free_pages * ps
        self.cm.check_invariant()

    @invariant()
    def rows_read_their_own_kv(self) -> None:
        ps = self.page_size
        for row, model in self.rows.items():
            d = self.cm.device_len(row)
            assert self.cm.cached_len(row) == model.locked
            slots = self.cm.page_table[row, :d].tolist()
            for p, slot in enumerate(slots):
                assert self.kv[slot] == tuple(model.tokens[: p + 1])
            for k in range(0, model.locked, ps):
                assert slots[k] // ps == self.cached[tuple(model.tokens[: k + ps])]

    @invariant()
    def every_page_in_one_place(self) -> None:
        ps = self.page_size
        places: list[int] = self.cm.free_pages().tolist()
        places += [s // ps for s in self.cm.prefix_cache.all_indices().tolist()[::ps]]
        for row, model in self.rows.items():
            slots = self.cm.page_table[row, : self.cm.device_len(row)].tolist()
            places += [s // ps for s in slots[model.locked :: ps]]
        assert sorted(places) == list(range(self.num_pages))


def machine(cache: str, page_size: int, examples: int = 30) -> type[CacheMachine]:
    cls = type(
        f"CacheMachine_{cache}_{page_size}",
        (CacheMachine,),
        {"cache_name": cache, "page_size": page_size},
    )
    cls.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    return cls


TestRadixPage1 = machine("radix", 1).TestCase
TestRadixPage4 = machine("radix", 4).TestCase
TestRadixPage16 = machine("radix", 16).TestCase
TestRadixPage64 = machine("radix", 64, examples=10).TestCase
TestNaivePage1 = machine("naive", 1, examples=20).TestCase
TestNaivePage16 = machine("naive", 16, examples=20).TestCase
