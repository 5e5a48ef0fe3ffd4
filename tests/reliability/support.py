"""Clients, metrics and stream parsing shared by the reliability tests, and the suite counters.

Every HTTP request of the suite goes through :func:`http_client` or :func:`async_client`, so
the end-of-run summary can report how many requests were sent (API calls and ``/health`` or
``/metrics`` probes apart; the harness's own startup polls are not counted).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import pytest

from tests.server_harness import parse_metrics

MODEL = "smollm2-135m"


class ServerLike(Protocol):
    url: str
    headers: dict[str, str]


PROBE_PATHS = ("/health", "/metrics")


@dataclass
class SuiteStats:
    """What the suite did, printed at the end of the run."""

    requests: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)
    disconnect_to_free_s: list[float] = field(default_factory=list)
    notes: dict[str, object] = field(default_factory=dict)

    def count(self, request: httpx.Request) -> None:
        """Tally one request sent: a server probe (``/health``, ``/metrics``) or an API call."""
        self.requests["probe" if request.url.path in PROBE_PATHS else "api"] += 1

    def disconnect_quantile_ms(self, q: float) -> float | None:
        """The ``q`` quantile (nearest rank) of the disconnect -> KV free samples, in ms."""
        xs = sorted(self.disconnect_to_free_s)
        if not xs:
            return None
        return 1000 * xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


STATS = SuiteStats()


async def _acount(request: httpx.Request) -> None:
    STATS.count(request)


def http_client(timeout: float = 60.0, **kwargs: Any) -> httpx.Client:
    """A counted synchronous client."""
    return httpx.Client(timeout=timeout, event_hooks={"request": [STATS.count]}, **kwargs)


def async_client(timeout: float = 60.0, **kwargs: Any) -> httpx.AsyncClient:
    """A counted asyncio client without a connection cap."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(
        timeout=timeout, limits=limits, event_hooks={"request": [_acount]}, **kwargs
    )


# ---- /metrics ------------------------------------------------------------------------------


def read_metrics(http: httpx.Client, srv: ServerLike) -> dict[str, float]:
    return parse_metrics(http.get(f"{srv.url}/metrics").text)


async def aread_metrics(http: httpx.AsyncClient, srv: ServerLike) -> dict[str, float]:
    return parse_metrics((await http.get(f"{srv.url}/metrics")).text)


def is_idle(m: dict[str, float]) -> bool:
    """Nothing queued, running or in flight, no radix lock held, and every KV token free or
    evictable: the cache invariant at idle."""
    return (
        m["minisgl_num_running_requests"] == 0
        and m["minisgl_num_queued_requests"] == 0
        and m["minisgl_num_inflight_requests"] == 0
        and m["minisgl_kv_protected_tokens"] == 0
        and m["minisgl_kv_private_tokens"] == 0
        and m["minisgl_kv_free_tokens"] + m["minisgl_kv_evictable_tokens"]
        == m["minisgl_kv_total_tokens"]
        and m["minisgl_kv_total_tokens"] > 0
    )


def gauges(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if "_bucket" not in k and "seconds" not in k}


def wait_idle(srv: ServerLike, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until :func:`is_idle`; fail with the last snapshot at the deadline."""
    deadline = time.monotonic() + timeout
    with http_client(timeout=5.0) as http:
        while True:
            m = read_metrics(http, srv)
            if is_idle(m):
                return m
            if time.monotonic() > deadline:
                pytest.fail(f"server not idle after {timeout}s: {gauges(m)}")
            time.sleep(0.02)


def finish_counts(m: dict[str, float]) -> Counter:
    prefix = 'minisgl_requests_total{finish_reason="'
    return Counter({k[len(prefix) : -2]: int(v) for k, v in m.items() if k.startswith(prefix)})


def delta(after: Counter, before: Counter) -> Counter:
    out = Counter(after)
    out.subtract(before)
    return +out


# ---- responses -----------------------------------------------------------------------------


def sse_payloads(lines: Iterable[str]) -> Iterator[dict[str, Any] | str]:
    """Parsed ``data:`` payloads of SSE lines (``"[DONE]"`` stays a string)."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        yield data if data == "[DONE]" else json.loads(data)


async def asse_payloads(lines: AsyncIterable[str]) -> AsyncIterator[dict[str, Any] | str]:
    async for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


@dataclass
class Outcome:
    """One response, streamed or not, reduced to what the tests compare."""

    status: int
    texts: dict[int, str] = field(default_factory=dict)
    deltas: dict[int, list[str]] = field(default_factory=dict)
    finishes: dict[int, list[str]] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    body: dict[str, Any] | None = None

    def text(self, index: int = 0) -> str:
        return self.texts.get(index, "")

    def finish(self, index: int = 0) -> str | None:
        f = self.finishes.get(index, [])
        return f[-1] if f else None


def choice_text(choice: dict[str, Any], chat: bool) -> str | None:
    if chat:
        return (choice.get("delta") or choice.get("message") or {}).get("content")
    return choice.get("text")


def parse_body(status: int, body: dict[str, Any], chat: bool) -> Outcome:
    out = Outcome(status, body=body)
    if status != 200:
        out.errors.append(body.get("error", body))
        return out
    for ch in body["choices"]:
        out.texts[ch["index"]] = choice_text(ch, chat) or ""
        out.finishes.setdefault(ch["index"], []).append(ch["finish_reason"])
    out.usage = body.get("usage")
    return out


def parse_stream(status: int, lines: Iterable[str], chat: bool) -> Outcome:
    out = Outcome(status)
    for payload in sse_payloads(lines):
        assert not out.done, "data after [DONE]"
        if payload == "[DONE]":
            out.done = True
            continue
        if "error" in payload:
            out.errors.append(payload["error"])
            continue
        if payload.get("usage"):
            out.usage = payload["usage"]
        for ch in payload["choices"]:
            i = ch["index"]
            piece = choice_text(ch, chat)
            if piece:
                out.deltas.setdefault(i, []).append(piece)
            out.texts.setdefault(i, "")
            out.texts[i] += piece or ""
            if ch.get("finish_reason"):
                out.finishes.setdefault(i, []).append(ch["finish_reason"])
    return out


def _json_or_raw(r: httpx.Response) -> dict[str, Any]:
    try:
        data = r.json()
    except ValueError:
        return {"error": {"message": f"not JSON: {r.text[:200]!r}", "raw": True}}
    return data if isinstance(data, dict) else {"error": {"message": repr(data), "raw": True}}


def request(http: httpx.Client, path: str, body: dict[str, Any]) -> Outcome:
    """POST ``body`` (streamed when ``body["stream"]``) and parse the answer."""
    chat = path.endswith("/chat/completions")
    if not body.get("stream"):
        r = http.post(path, json=body)
        return parse_body(r.status_code, _json_or_raw(r), chat)
    with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            r.read()
            return parse_body(r.status_code, _json_or_raw(r), chat)
        return parse_stream(r.status_code, r.iter_lines(), chat)


async def arequest(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Outcome:
    chat = path.endswith("/chat/completions")
    if not body.get("stream"):
        r = await http.post(path, json=body)
        return parse_body(r.status_code, _json_or_raw(r), chat)
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return parse_body(r.status_code, _json_or_raw(r), chat)
        lines = [line async for line in r.aiter_lines()]
        return parse_stream(r.status_code, lines, chat)
