"""Process faults: a worker killed with SIGKILL, and SIGTERM under load.

Each test gets a fresh server (process group of its own). A dead worker must turn
``/health`` to 503, end every request in flight with an error (no hang), and make the
launcher exit non-zero with no process of the group left. SIGTERM must end requests in
flight (finished or "abort"), refuse new ones, and stop every process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import httpx
import pytest

from tests.reliability.support import (
    MODEL,
    STATS,
    Outcome,
    aread_metrics,
    arequest,
    async_client,
    gauges,
)
from tests.server_harness import Server, pid_alive, wait_group_gone

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
IN_FLIGHT = 8
EXIT_TIMEOUT_S = 20.0
CHILD_NAMES = {
    "minisgl-sched-0": "scheduler-0",
    "minisgl-tok": "tokenizer",
    "minisgl-detok": "detokenizer",
}


def long_body(i: int, stream: bool) -> tuple[str, dict[str, Any]]:
    common = {"model": MODEL, "max_tokens": 300, "ignore_eos": True, "stream": stream}
    if i % 2:
        return CHAT, {**common, "messages": [{"role": "user", "content": f"Story {i}, please."}]}
    return COMPLETIONS, {**common, "prompt": f"Chapter {i}. It was a dark and stormy night"}


async def start_load(http: httpx.AsyncClient, srv: Server, n: int) -> list[asyncio.Future[Outcome]]:
    """``n`` long requests (half streamed), returned once all of them are decoding."""
    tasks = [asyncio.ensure_future(arequest(http, *long_body(i, i % 2 == 0))) for i in range(n)]
    deadline = time.monotonic() + 60
    while True:
        m = await aread_metrics(http, srv)
        if m["minisgl_num_running_requests"] >= n and m["minisgl_kv_private_tokens"] > 0:
            return tasks
        for t in tasks:
            if t.done():
                pytest.fail(f"a long request ended early: {t.result()}")
        assert time.monotonic() < deadline, gauges(m)
        await asyncio.sleep(0.02)


async def requests_until_exit(
    http: httpx.AsyncClient, srv: Server, deadline: float
) -> list[Outcome | httpx.HTTPError]:
    """New requests, one after another, until the launcher exits (or ``deadline``): each
    answer, or the connection error once nothing listens."""
    late: list[Outcome | httpx.HTTPError] = []
    i = 0
    while srv.proc.poll() is None and time.monotonic() < deadline:
        try:
            late.append(await asyncio.wait_for(arequest(http, *long_body(i, False)), timeout=15))
        except httpx.HTTPError as exc:
            late.append(exc)
        i += 1
        await asyncio.sleep(0.02)
    return late


async def poll_health(http: httpx.AsyncClient, srv: Server, stop: asyncio.Event) -> list[int]:
    codes: list[int] = []
    while not stop.is_set():
        try:
            codes.append((await http.get(f"{srv.url}/health", timeout=2.0)).status_code)
        except httpx.HTTPError:
            codes.append(0)
        await asyncio.sleep(0.01)
    return codes


@pytest.mark.parametrize("victim", sorted(CHILD_NAMES))
def test_worker_killed(fault_server: Server, victim: str) -> None:
    srv = fault_server
    workers = srv.workers()
    assert sorted(workers.values()) == ["minisgl-detok", "minisgl-sched-0", "minisgl-tok"]
    pid = srv.worker_pid(victim)

    async def go() -> tuple[list[Outcome], list[int], list[Any]]:
        async with async_client(timeout=60.0, base_url=srv.url) as http:
            tasks = await start_load(http, srv, IN_FLIGHT)
            stop = asyncio.Event()
            health = asyncio.ensure_future(poll_health(http, srv, stop))
            await asyncio.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            late = await requests_until_exit(http, srv, time.monotonic() + EXIT_TIMEOUT_S)
            stop.set()
            return results, await health, late

    t0 = time.monotonic()
    results, health, late = asyncio.run(go())
    code = srv.proc.wait(EXIT_TIMEOUT_S)
    STATS.notes[f"kill {victim}: launcher exit after (s)"] = round(time.monotonic() - t0, 2)
    assert code != 0
    for out in results:
        assert out.errors, out
        assert out.errors[0]["type"] == "service_unavailable_error", out.errors
        if out.status == 200:
            assert out.done and not any(f in ("stop", "length") for f in out.finishes.get(0, []))
        else:
            assert out.status == 503
    assert 503 in health, health
    for item in late:
        assert isinstance(item, httpx.HTTPError) or item.status == 503, item
    assert f"{CHILD_NAMES[victim]} died" in srv.log()
    assert not wait_group_gone(srv.proc.pid, 10.0), "orphans left behind"


def test_sigterm_under_load(fault_server: Server) -> None:
    srv = fault_server
    workers = srv.workers()
    assert len(workers) == 3

    async def go() -> tuple[list[Outcome], list[Any], float]:
        async with async_client(timeout=60.0, base_url=srv.url) as http:
            tasks = await start_load(http, srv, IN_FLIGHT)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            late = await requests_until_exit(http, srv, t0 + EXIT_TIMEOUT_S)
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
            return results, late, time.monotonic() - t0

    results, late, elapsed = asyncio.run(go())
    code = srv.proc.wait(EXIT_TIMEOUT_S)
    STATS.notes["sigterm: launcher exit after (s)"] = round(elapsed, 2)
    assert code == 0, srv.log()[-3000:]
    for out in results:
        assert out.status == 200, out
        assert not out.errors, out.errors
        assert out.finish() in ("abort", "length"), out
        if out.body is None:
            assert out.done
    assert any(out.finish() == "abort" for out in results)
    for item in late:
        assert isinstance(item, httpx.HTTPError) or item.status == 503, item
    STATS.notes["sigterm: new requests answered 503 / refused"] = (
        f"{sum(not isinstance(i, Exception) for i in late)}"
        f" / {sum(isinstance(i, Exception) for i in late)}"
    )
    assert not wait_group_gone(srv.proc.pid, 10.0), "orphans left behind"
    assert not any(pid_alive(p) for p in workers)


def test_sigterm_to_the_process_group_is_a_clean_stop(fault_server: Server) -> None:
    """systemd, `timeout` and `kill -- -PGID` signal every process of the group: the
    children's exits must read as a stop, not as crashes."""
    srv = fault_server
    workers = srv.workers()
    os.killpg(srv.proc.pid, signal.SIGTERM)
    code = srv.proc.wait(EXIT_TIMEOUT_S)
    log = srv.log()
    assert code == 0, log[-3000:]
    assert " died " not in log, log[-3000:]
    assert not wait_group_gone(srv.proc.pid, 10.0), "orphans left behind"
    assert not any(pid_alive(p) for p in workers)
