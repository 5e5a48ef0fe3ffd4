"""A deliberately small KV pool: retraction keeps outputs exact, the impossible is refused
alone, and a full queue answers 503 at once.

The ``pressure`` server has 640 KV tokens (pages of 4), 64 running slots and room for 8 more
requests in flight. References come from the ``main`` server (16384 KV tokens: no pressure).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from tests.reliability.conftest import PRESSURE_KV_TOKENS, PRESSURE_MAX_QUEUED, PRESSURE_MAX_RUNNING
from tests.reliability.support import (
    MODEL,
    STATS,
    Outcome,
    aread_metrics,
    arequest,
    async_client,
    finish_counts,
    gauges,
    http_client,
    read_metrics,
    wait_idle,
)
from tests.server_harness import Server

pytestmark = pytest.mark.slow

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
CONCURRENT = 64
GEN_TOKENS = 24
TOPICS = ["rivers", "castles", "robots", "bread", "comets", "violins", "deserts", "owls"]


def pressure_bodies() -> list[dict[str, Any]]:
    return [
        {
            "model": MODEL,
            "prompt": f"Fact {i}: the most surprising thing about {TOPICS[i % len(TOPICS)]} is",
            "max_tokens": GEN_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
        }
        for i in range(CONCURRENT)
    ]


async def run_all(srv: Server, items: list[tuple[str, dict[str, Any]]]) -> list[Outcome]:
    async with async_client(timeout=300.0, base_url=srv.url, headers=srv.headers) as http:
        return await asyncio.gather(*(arequest(http, p, b) for p, b in items))


def test_kv_exhaustion_retracts_and_keeps_outputs(
    pressure_server: Server, main_server: Server
) -> None:
    items = [(COMPLETIONS, b) for b in pressure_bodies()]
    reference = asyncio.run(run_all(main_server, items))
    with http_client() as http:
        before = read_metrics(http, pressure_server)
    t0 = time.monotonic()
    pressured = asyncio.run(run_all(pressure_server, items))
    elapsed = time.monotonic() - t0
    after = wait_idle(pressure_server, timeout=60)

    retractions = after["minisgl_retractions_total"] - before["minisgl_retractions_total"]
    STATS.notes["kv pressure: retractions"] = int(retractions)
    STATS.notes[f"kv pressure: {CONCURRENT} x {GEN_TOKENS} tokens (s)"] = round(elapsed, 1)
    assert retractions > 0, "the pool was never short: the test proves nothing"
    mismatched = []
    for i, (ref, got) in enumerate(zip(reference, pressured, strict=True)):
        assert ref.status == 200 and got.status == 200, (ref.errors, got.errors)
        assert got.finish() == "length" and got.usage["completion_tokens"] == GEN_TOKENS
        if got.text() != ref.text():
            mismatched.append((i, ref.text(), got.text()))
    assert not mismatched, mismatched[:3]
    counts = finish_counts(after)
    counts.subtract(finish_counts(before))
    assert +counts == {"length": CONCURRENT}, counts


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def test_prompt_that_can_never_fit_fails_alone(
    pressure_server: Server, main_server: Server
) -> None:
    """Prompts longer than the whole pool (and one exactly as long: it leaves no room for the
    first sampled token's successor) get an error, streamed or not; the requests running
    beside them are unaffected."""
    normal = [(COMPLETIONS, b) for b in pressure_bodies()[:6]]
    reference = asyncio.run(run_all(main_server, normal))
    huge = {"model": MODEL, "prompt": token_prompt(PRESSURE_KV_TOKENS + 60, 1), "max_tokens": 4}
    exact = {**huge, "prompt": token_prompt(PRESSURE_KV_TOKENS, 2)}
    doomed = [
        (COMPLETIONS, {**huge, "stream": False}),
        (COMPLETIONS, {**huge, "stream": True}),
        (COMPLETIONS, {**exact, "stream": False}),
        (COMPLETIONS, {**exact, "stream": True}),
    ]
    outcomes = asyncio.run(run_all(pressure_server, [*doomed, *normal]))
    for (_, body), out in zip(doomed, outcomes, strict=False):
        if body["stream"] and out.status == 200:
            assert out.errors and out.done and not out.text(), out
        else:
            assert out.status == 400, out
        err = out.errors[0]
        assert "KV" in err["message"] or "fit" in err["message"], err
    for ref, got in zip(reference, outcomes[len(doomed) :], strict=True):
        assert got.status == 200 and got.text() == ref.text()
    wait_idle(pressure_server, timeout=30)


def test_prompt_at_pool_boundary_and_growth_past_it(
    pressure_server: Server, main_server: Server
) -> None:
    """A prompt one token short of the pool still gets its token; a request that outgrows the
    pool while alone ends (length) instead of looping, with the unpressured prefix."""
    edge = {"model": MODEL, "prompt": token_prompt(PRESSURE_KV_TOKENS - 1, 3), "max_tokens": 1}
    grow = {
        "model": MODEL,
        "prompt": token_prompt(PRESSURE_KV_TOKENS - 20, 4),
        "max_tokens": 40,
        "ignore_eos": True,
        "temperature": 0,
    }
    (ref_grow,) = asyncio.run(run_all(main_server, [(COMPLETIONS, grow)]))
    edge_out, grow_out = asyncio.run(
        run_all(pressure_server, [(COMPLETIONS, edge), (COMPLETIONS, grow)])
    )
    assert edge_out.status == 200 and edge_out.usage["completion_tokens"] == 1
    assert grow_out.status == 200, grow_out.errors
    assert grow_out.finish() == "length"
    assert 1 <= grow_out.usage["completion_tokens"] <= 21
    assert ref_grow.text().startswith(grow_out.text())
    wait_idle(pressure_server, timeout=30)


def test_full_queue_answers_503_promptly(pressure_server: Server) -> None:
    capacity = PRESSURE_MAX_RUNNING + PRESSURE_MAX_QUEUED
    body = {
        "model": MODEL,
        "prompt": "Tell me everything about the moon.",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }

    async def go() -> tuple[list[Outcome], list[float], dict[str, float]]:
        async with async_client(
            timeout=120.0, base_url=pressure_server.url, headers=pressure_server.headers
        ) as http:
            opened = asyncio.Queue()

            async def hold() -> None:
                async with http.stream("POST", COMPLETIONS, json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    opened.put_nowait(1)
                    async for _ in r.aiter_lines():
                        pass

            holders = [asyncio.ensure_future(hold()) for _ in range(capacity)]
            deadline = time.monotonic() + 60
            for _ in range(capacity):
                left = deadline - time.monotonic()
                await asyncio.wait_for(opened.get(), timeout=max(left, 0.1))
            m = await aread_metrics(http, pressure_server)
            assert m["minisgl_num_inflight_requests"] == capacity, gauges(m)
            extra: list[Outcome] = []
            times: list[float] = []
            for stream in (False, True, False, True, False, True):
                t0 = time.monotonic()
                out = await asyncio.wait_for(
                    arequest(http, COMPLETIONS, {**body, "max_tokens": 4, "stream": stream}), 10
                )
                times.append(time.monotonic() - t0)
                extra.append(out)
            t0 = time.monotonic()
            out = await asyncio.wait_for(
                arequest(http, CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 2}), 10
            )
            times.append(time.monotonic() - t0)
            extra.append(out)
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return extra, times, m

    extra, times, _ = asyncio.run(go())
    STATS.notes["full queue: slowest 503 (ms)"] = round(1000 * max(times), 1)
    for out in extra:
        assert out.status == 503, out
        err = out.errors[0]
        assert err["type"] == "service_unavailable_error" and err["code"] == "server_overloaded"
    wait_idle(pressure_server, timeout=60)
    with http_client(base_url=pressure_server.url) as http:
        r = http.post(COMPLETIONS, json={**body, "stream": False, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
