"""Scheduler behaviour on a model-free engine: batching, reuse, chunking, pressure, aborts."""

from __future__ import annotations

import random

import pytest

from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import RequestOutput, Scheduler

from .fake_engine import FakeEngine


def collect(outputs: list[RequestOutput]) -> dict[str, RequestOutput | list]:
    tokens: dict[str, list[int]] = {}
    final: dict[str, RequestOutput] = {}
    for o in outputs:
        tokens.setdefault(o.rid, []).extend(o.new_token_ids)
        if o.finished:
            assert o.rid not in final, f"{o.rid} finished twice"
            final[o.rid] = o
    return {rid: (tokens.get(rid, []), final[rid].finish_reason) for rid in final}


def make_workload(n: int, seed: int = 0, shared: int = 3) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 97) for _ in range(rng.randrange(40, 120))] for _ in range(shared)]
    work = []
    for i in range(n):
        prompt = rng.choice(systems) + [rng.randrange(1, 97) for _ in range(rng.randrange(1, 60))]
        work.append((f"r{i}", prompt, rng.randrange(1, 40)))
    return work


def run(work, num_pages=20000, page_size=1, cache="radix", ignore_eos=True, **cfg):
    engine = FakeEngine(num_pages=num_pages, page_size=page_size)
    sched = Scheduler(engine, SchedulerConfig(cache=cache, debug_invariant=True, **cfg))
    for rid, prompt, max_tokens in work:
        sched.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))
    outs = sched.run_until_idle()
    sched.check_idle()
    return collect(outs), sched, engine


def alone(work, **kw):
    result = {}
    for item in work:
        r, _, _ = run([item], **kw)
        result.update(r)
    return result


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("cache", ["radix", "naive"])
def test_batched_equals_alone(page_size: int, cache: str) -> None:
    work = make_workload(48)
    ref = alone(work, page_size=page_size, cache="naive")
    got, sched, engine = run(work, page_size=page_size, cache=cache)
    assert got == ref
    assert all(reason == "length" for _, reason in got.values())
    assert max(engine.batch_sizes) > 8, "requests were not batched"


def test_radix_reuses_shared_prefixes() -> None:
    work = make_workload(48)
    _, radix, e_radix = run(work, cache="radix", max_running_requests=4)
    _, naive, e_naive = run(work, cache="naive", max_running_requests=4)
    prompt_tokens = sum(len(p) for _, p, _ in work)
    assert e_radix.extend_tokens < e_naive.extend_tokens
    assert naive.prefill_tokens_total >= prompt_tokens
    assert radix.prefill_tokens_total < 0.5 * prompt_tokens


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_identical(page_size: int) -> None:
    rng = random.Random(1)
    work = [(f"c{i}", [rng.randrange(1, 97) for _ in range(300)], 20) for i in range(6)]
    ref = alone(work, page_size=page_size)
    got, _, engine = run(work, page_size=page_size, max_prefill_length=32)
    assert got == ref
    assert engine.forward_calls > 6 * 300 // 32


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("cache", ["radix", "naive"])
@pytest.mark.parametrize("mixed", [True, False])
def test_pressure_retracts_and_outputs_unchanged(page_size: int, cache: str, mixed: bool) -> None:
    work = make_workload(24, seed=3)
    ref = alone(work, page_size=page_size)
    pages = 700 // page_size
    got, sched, _ = run(work, num_pages=pages, page_size=page_size, cache=cache, mixed=mixed)
    assert got == ref
    assert sched.retractions_total >= 1


def test_prompt_larger_than_pool_errors_alone() -> None:
    work = make_workload(6, seed=5)
    huge = ("huge", list(range(1, 90)) * 10, 5)
    got, sched, _ = run([*work, huge], num_pages=400)
    assert got["huge"] == ([], "error")
    ref = alone(work, num_pages=400)
    assert {k: v for k, v in got.items() if k != "huge"} == ref


def test_eos_min_tokens_and_stop_token_ids() -> None:
    engine = FakeEngine(num_pages=4000, vocab=3)
    sched = Scheduler(engine, SchedulerConfig(debug_invariant=True))
    sched.add_request("eos", [1, 2, 1, 2], SamplingParams(max_tokens=200))
    sched.add_request("min", [1, 2, 1, 2], SamplingParams(max_tokens=200, min_tokens=50))
    sched.add_request("stopid", [2, 2, 1], SamplingParams(max_tokens=200, stop_token_ids=[1]))
    got = collect(sched.run_until_idle())
    toks, reason = got["eos"]
    assert reason == "stop" and toks[-1] == 0 and 0 not in toks[:-1]
    toks, reason = got["min"]
    assert len(toks) >= 51 and 0 not in toks[:50]
    toks, reason = got["stopid"]
    assert reason == "stop" and toks[-1] in (0, 1)
    sched.check_idle()


@pytest.mark.parametrize("cache", ["radix", "naive"])
def test_abort_at_every_stage_leaves_invariant_exact(cache: str) -> None:
    rng = random.Random(7)
    engine = FakeEngine(num_pages=3000, page_size=16)
    sched = Scheduler(
        engine,
        SchedulerConfig(cache=cache, max_prefill_length=64, max_running_requests=8),
    )
    work = make_workload(40, seed=11)
    for rid, prompt, _ in work:
        sched.add_request(rid, prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    aborted: set[str] = set()
    outs: list[RequestOutput] = []
    while sched.has_work():
        live = list(sched.requests)
        for rid in live:
            if rng.random() < 0.08:
                sched.abort(rid)
                aborted.add(rid)
        outs.extend(sched.step())
        sched.cache.check_invariant()
    got = collect(outs)
    assert set(got) == {rid for rid, _, _ in work}
    assert all(got[r][1] == "abort" for r in aborted)
    sched.check_idle()
    assert sched.cache.stats().private == 0


def test_queue_limit_rejects_promptly() -> None:
    engine = FakeEngine(num_pages=1000)
    sched = Scheduler(engine, SchedulerConfig(max_queued_requests=2))
    for i in range(3):
        sched.add_request(f"q{i}", [1, 2, 3], SamplingParams(max_tokens=2))
    first = sched.step()
    errors = [o for o in first if o.finish_reason == "error"]
    assert [o.rid for o in errors] == ["q2"] and "queued" in errors[0].error
    got = collect(first + sched.run_until_idle())
    assert got["q0"][1] == got["q1"][1] == "length"


def test_concurrent_arrivals_share_prefixes_within_a_batch() -> None:
    work = make_workload(48)
    got, radix, _ = run(work, cache="radix")
    prompt_tokens = sum(len(p) for _, p, _ in work)
    assert radix.prefill_tokens_total < 0.5 * prompt_tokens
    assert got == alone(work)


def test_reported_cached_tokens_count_reuse_after_deferral() -> None:
    work = make_workload(48)
    engine = FakeEngine(num_pages=20000)
    sched = Scheduler(engine, SchedulerConfig(cache="radix"))
    for rid, prompt, max_tokens in work:
        sched.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    final = [o for o in sched.run_until_idle() if o.finished]
    prompt_tokens = sum(o.prompt_tokens for o in final)
    cached = sum(o.cached_tokens for o in final)
    assert cached == prompt_tokens - sched.prefill_tokens_total
    assert cached > 0.5 * prompt_tokens
