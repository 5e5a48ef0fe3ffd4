"""Benchmark of the prefix caches and the cache manager (host only, no model).

Sections (each for every page size given):

- requests: 10,000 requests of ~2,000 tokens whose first ~1,500 tokens are one of 50 shared
  system prompts; per request ``match_prefix`` + ``lock_handle`` + ``insert_prefix`` +
  ``unlock_handle`` on a tree kept under a cap by evicting (timed apart).
- evict: a tree of 100,000 cached tokens emptied by ``evict(page_size)`` calls (one leaf per
  call) and rebuilt and emptied by ``evict(2000)`` calls.
- growth: the per-request cost against prompt length (tree fixed) and against tree size
  (prompt fixed), and the per-call evict cost against tree size.
- manager: ``CacheManager`` per request (match + admit + allocate + release) and per decode
  ``allocate(row, 1)``.

Usage: ``python scripts/bench_cache.py [--requests 10000] [--page-sizes 1 16] [--quick]``.
Times are the thread's CPU time (``time.thread_time_ns``, so a loaded machine's preemptions do
not count) in microseconds. The request lists are built first and frozen out of the garbage
collector (``gc.freeze``) so that collections over the benchmark's own data are not charged to
the cache.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from minisgl.kvcache import RadixPrefixCache, make_prefix_cache  # noqa: E402
from minisgl.kvcache.base import BasePrefixCache  # noqa: E402
from minisgl.scheduler.cache_manager import CacheManager  # noqa: E402

VOCAB = 32000
clock = time.thread_time_ns


class Workload:
    """Requests = one of ``num_prompts`` shared system prompts + a unique user part."""

    def __init__(self, num_prompts: int, length: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.length = length
        sys_len = self.rng.integers(int(0.6 * length), int(0.9 * length), num_prompts)
        self.prompts = [self.rng.integers(0, VOCAB, n).tolist() for n in sys_len]

    def request(self) -> list[int]:
        prompt = self.prompts[int(self.rng.integers(len(self.prompts)))]
        total = int(self.rng.integers(int(0.9 * self.length), int(1.1 * self.length) + 1))
        return prompt + self.rng.integers(0, VOCAB, max(1, total - len(prompt))).tolist()


class SlotSource:
    """Hands out fresh page-aligned slots, standing in for the free pool."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.next = 0

    def take(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next, self.next + n, dtype=torch.int32)
        self.next += -(-n // self.page_size) * self.page_size
        return out


def serve(
    cache: BasePrefixCache, slots: SlotSource, tokens: list[int], times: list[list[int]] | None
) -> int:
    """One request's cache traffic; appends (match, lock, insert, unlock) ns to ``times`` and
    returns the matched length."""
    t0 = clock()
    match = cache.match_prefix(tokens[:-1])
    t1 = clock()
    cache.lock_handle(match.handle)
    t2 = clock()
    indices = torch.cat([match.indices, slots.take(len(tokens) - match.cached_len)])
    t3 = clock()
    cache.insert_prefix(tokens, indices)
    t4 = clock()
    cache.unlock_handle(match.handle)
    t5 = clock()
    if times is not None:
        times.append([t1 - t0, t2 - t1, t4 - t3, t5 - t4])
    return match.cached_len


def us(ns: float) -> str:
    return f"{ns / 1e3:8.1f}"


def bench_requests(page_size: int, num_requests: int, length: int, cap: int) -> dict[str, float]:
    work = Workload(50, length)
    reqs = [work.request() for _ in range(num_requests)]
    gc.collect()
    gc.freeze()
    cache = RadixPrefixCache(page_size)
    slots = SlotSource(page_size)
    times: list[list[int]] = []
    evict_ns: list[int] = []
    hit = 0
    for tokens in reqs:
        hit += serve(cache, slots, tokens, times)
        if cache.size > cap:
            t0 = clock()
            cache.evict(cache.size - cap)
            evict_ns.append(clock() - t0)
    totals = [sum(t) for t in times]
    cols = list(zip(*times, strict=True))
    return {
        "match": statistics.median(cols[0]),
        "lock": statistics.median(cols[1]),
        "insert": statistics.median(cols[2]),
        "unlock": statistics.median(cols[3]),
        "mean": statistics.fmean(totals),
        "p50": statistics.median(totals),
        "p99": sorted(totals)[int(0.99 * len(totals))],
        "evict": statistics.fmean(evict_ns) if evict_ns else 0.0,
        "evict_calls": len(evict_ns),
        "tokens": statistics.fmean(len(r) for r in reqs),
        "hit": hit / sum(len(r) for r in reqs),
        "size": cache.size,
    }


def build_tree(page_size: int, size: int, length: int, num_prompts: int) -> RadixPrefixCache:
    work = Workload(num_prompts, length, seed=1)
    cache = RadixPrefixCache(page_size)
    slots = SlotSource(page_size)
    while cache.size < size:
        serve(cache, slots, work.request(), None)
    return cache


def bench_evict(
    page_size: int, size: int, amount: int, length: int = 2000
) -> tuple[float, float, float, int]:
    """Emptying a tree of ``size`` tokens by evict(amount) calls: median and mean ns per call,
    mean ns per evicted node, number of calls."""
    cache = build_tree(page_size, size, length, max(1, size // 2000))
    gc.collect()
    gc.freeze()
    nodes = len(cache._nodes())
    per_call: list[int] = []
    while cache.size:
        t0 = clock()
        cache.evict(amount)
        per_call.append(clock() - t0)
    total = sum(per_call)
    return statistics.median(per_call), total / len(per_call), total / nodes, len(per_call)


def bench_requests_on_tree(page_size: int, tree: int, length: int, n: int) -> float:
    cache = build_tree(page_size, tree, 2000, max(1, tree // 2000)) if tree else None
    cache = cache or RadixPrefixCache(page_size)
    gc.collect()
    gc.freeze()
    slots = SlotSource(page_size)
    slots.next = 1 << 30
    work = Workload(50, length, seed=2)
    reqs = [work.request() for _ in range(n)]
    gc.collect()
    gc.freeze()
    times: list[list[int]] = []
    for tokens in reqs:
        serve(cache, slots, tokens, times)
    return statistics.median(sum(t) for t in times)


def bench_manager(page_size: int, num_requests: int, length: int) -> tuple[float, float]:
    """Median ns per request (match+admit+allocate+release) and per decode allocate."""
    num_pages = 300_000 // page_size
    cm = CacheManager(num_pages, page_size, 64, 4 * length, make_prefix_cache("radix", page_size))
    work = Workload(50, length)
    reqs = [work.request() for _ in range(num_requests)]
    gc.collect()
    gc.freeze()
    per_req: list[int] = []
    for tokens in reqs:
        t0 = clock()
        match = cm.match_prefix(tokens[:-1])
        cm.admit(0, match)
        cm.allocate(0, len(tokens) - match.cached_len)
        cm.release(0, tokens)
        per_req.append(clock() - t0)
    for row in range(64):
        cm.admit(row, cm.match_prefix([]))
    per_tok: list[int] = []
    for _ in range(50):
        for row in range(64):
            t0 = clock()
            cm.allocate(row, 1)
            per_tok.append(clock() - t0)
    cm.check_invariant()
    return statistics.median(per_req), statistics.median(per_tok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--length", type=int, default=2000)
    ap.add_argument("--cap", type=int, default=500_000, help="tree size kept by evicting")
    ap.add_argument("--quick", action="store_true", help="fewer requests, smaller sweeps")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = 1000 if args.quick else args.requests
    sweep_n = 300 if args.quick else 2000

    sample = Workload(1, args.length).request()
    t0 = clock()
    for _ in range(200):
        tuple(sample)
    yardstick = (clock() - t0) / 200
    print(f"== machine yardstick: tuple() of a {len(sample)}-int list takes {us(yardstick)} us")
    print(f"== requests: {n} x ~{args.length} tokens, 50 system prompts, tree cap {args.cap}")
    print(" ps  median per op: match lock insert unlock | per request: mean p50 p99 | evict/call")
    for ps in args.page_sizes:
        r = bench_requests(ps, n, args.length, args.cap)
        print(
            f"{ps:3d} {us(r['match'])}{us(r['lock'])}{us(r['insert'])}{us(r['unlock'])} |"
            f"{us(r['mean'])}{us(r['p50'])}{us(r['p99'])}                 |"
            f"{us(r['evict'])} ({r['evict_calls']} calls)"
        )
        print(f"    mean {r['tokens']:.0f} tokens/request, {100 * r['hit']:.0f}% matched")

    print("== evict: tree of 100,000 cached tokens, emptied")
    print(" ps  amount  median/call mean/call mean/node  calls")
    for ps in args.page_sizes:
        for amount in (ps, 2000):
            med, mean, per_node, calls = bench_evict(ps, 100_000, amount)
            print(f"{ps:3d} {amount:7d}    {us(med)}  {us(mean)}  {us(per_node)} {calls:6d}")

    print("== growth with prompt length (empty tree at start; median us/request)")
    lengths = [500, 1000, 2000, 4000, 8000]
    print(" ps " + "".join(f"{x:>9d}" for x in lengths))
    for ps in args.page_sizes:
        row = [bench_requests_on_tree(ps, 0, x, sweep_n) for x in lengths]
        print(f"{ps:3d} " + "".join(f"{us(v):>9s}" for v in row))

    print("== growth with tree size (2,000-token requests; median us/request)")
    trees = [10_000, 100_000, 1_000_000] if not args.quick else [10_000, 100_000]
    print(" ps " + "".join(f"{x:>10d}" for x in trees))
    for ps in args.page_sizes:
        row = [bench_requests_on_tree(ps, t, 2000, sweep_n) for t in trees]
        print(f"{ps:3d} " + "".join(f"{us(v):>10s}" for v in row))

    print("== evict(one page) against tree size (median us/call)")
    print(" ps " + "".join(f"{x:>10d}" for x in trees))
    for ps in args.page_sizes:
        row = [bench_evict(ps, t, ps, length=500)[0] for t in trees]
        print(f"{ps:3d} " + "".join(f"{us(v):>10s}" for v in row))

    print("== CacheManager (median us): request = match+admit+allocate+release; decode allocate")
    for ps in args.page_sizes:
        per_req, per_tok = bench_manager(ps, sweep_n, args.length)
        print(f"{ps:3d} request {us(per_req)}   allocate(row, 1) {us(per_tok)}")


if __name__ == "__main__":
    main()
