"""A burst of 300 concurrent mixed requests: every choice finishes exactly once, greedy
choices match their one-at-a-time references exactly (with random stop strings and lengths),
and the server ends idle with the cache invariant exact.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.reliability.support import (
    MODEL,
    STATS,
    Outcome,
    arequest,
    async_client,
    finish_counts,
    http_client,
    read_metrics,
    request,
    wait_idle,
)
from tests.server_harness import Server

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BURST = 300
MAX_TOKENS = 10
SEED = 1129
CHAT_PROMPTS = [
    "Name three colors.",
    "What is 2+2?",
    "Say hello to Alice.",
    "Give me a fruit.",
    "Describe rain briefly.",
    "What do cats eat?",
]
COMPLETION_PROMPTS = [
    "The capital of Italy is",
    "My favourite season is",
    "Water boils at",
    "The first month of the year is",
]


@dataclass(frozen=True)
class Reference:
    """A greedy run of ``MAX_TOKENS``: its tokens' text (EOS excluded) and how it ended."""

    path: str
    prompt: str
    tokens: tuple[str, ...]
    eos: bool

    def expect(self, max_tokens: int, stop: str | None) -> tuple[str, str]:
        """The text and finish reason of the same request with ``max_tokens`` and ``stop``."""
        text = "".join(self.tokens[:max_tokens])
        reason = "stop" if self.eos and max_tokens > len(self.tokens) else "length"
        if stop and stop in text:
            return text[: text.index(stop)], "stop"
        return text, reason


def body_for(path: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, **extra}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def make_reference(http: httpx.Client, path: str, prompt: str) -> Reference:
    logprobs = {"logprobs": True} if path == CHAT else {"logprobs": 0}
    body = body_for(path, prompt, temperature=0, max_tokens=MAX_TOKENS, **logprobs)
    out = request(http, path, body)
    assert out.status == 200, out.errors
    assert out.body is not None
    lp = out.body["choices"][0]["logprobs"]
    tokens = [t["token"] for t in lp["content"]] if path == CHAT else list(lp["tokens"])
    eos = out.finish() == "stop"
    if eos:
        tokens = tokens[:-1]
    assert "".join(tokens) == out.text(), (tokens, out.text())
    return Reference(path, prompt, tuple(tokens), eos)


@dataclass
class Planned:
    path: str
    body: dict[str, Any]
    ref: Reference
    greedy: bool

    @property
    def n(self) -> int:
        return self.body.get("n", 1)


def plan(rng: random.Random, refs: list[Reference]) -> list[Planned]:
    out = []
    for _ in range(BURST):
        ref = rng.choice(refs)
        greedy = rng.random() < 0.7
        max_tokens = rng.randint(1, MAX_TOKENS)
        extra: dict[str, Any] = {"max_tokens": max_tokens, "n": rng.choice([1, 1, 2, 3, 4])}
        if greedy:
            extra["temperature"] = 0
        else:
            extra.update(temperature=0.9, seed=rng.randrange(2**31))
        text = "".join(ref.tokens)
        r = rng.random()
        if r < 0.4 and len(text) >= 4:
            start = rng.randrange(len(text) - 1)
            extra["stop"] = text[start : start + rng.randint(1, 4)]
        elif r < 0.55:
            extra["stop"] = ["@@never@@", "\u00a7\u00a7"]
        if rng.random() < 0.5:
            extra.update(stream=True, stream_options={"include_usage": True})
        out.append(Planned(ref.path, body_for(ref.path, ref.prompt, **extra), ref, greedy))
    return out


def check(p: Planned, out: Outcome) -> int:
    """Assert one response; return its completion tokens."""
    b = p.body
    assert out.status == 200, (b, out.errors)
    assert not out.errors, out.errors
    assert sorted(out.texts) == list(range(p.n)), (b, out.texts)
    if b.get("stream"):
        assert out.done
        for i in range(p.n):
            assert len(out.finishes.get(i, [])) == 1, (b, out.finishes)
    stop = b.get("stop")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    for i in range(p.n):
        text, reason = out.text(i), out.finish(i)
        assert reason in ("stop", "length"), (b, reason)
        assert not any(s in text for s in stops), (b, text)
        if p.greedy:
            single = stops[0] if len(stops) == 1 else None
            assert (text, reason) == p.ref.expect(b["max_tokens"], single), (b, text, reason)
    assert out.usage is not None, b
    used = out.usage["completion_tokens"]
    assert used <= p.n * b["max_tokens"], (b, out.usage)
    return used


def test_burst_of_300_mixed_requests(main_server: Server) -> None:
    with http_client(base_url=main_server.url, headers=main_server.headers) as http:
        wait_idle(main_server)
        refs = [make_reference(http, CHAT, p) for p in CHAT_PROMPTS]
        refs += [make_reference(http, COMPLETIONS, p) for p in COMPLETION_PROMPTS]
        before = read_metrics(http, main_server)
    planned = plan(random.Random(SEED), refs)
    choices = sum(p.n for p in planned)

    async def go() -> list[Outcome]:
        async with async_client(
            timeout=300.0, base_url=main_server.url, headers=main_server.headers
        ) as http:
            return await asyncio.gather(*(arequest(http, p.path, p.body) for p in planned))

    t0 = time.monotonic()
    outcomes = asyncio.run(go())
    elapsed = time.monotonic() - t0
    used = sum(check(p, out) for p, out in zip(planned, outcomes, strict=True))

    after = wait_idle(main_server, timeout=30)
    counts = finish_counts(after)
    counts.subtract(finish_counts(before))
    counts = +counts
    assert sum(counts.values()) == choices, counts
    assert set(counts) <= {"stop", "length"}, counts
    key = "minisgl_generation_tokens_total"
    assert after[key] - before[key] == used
    STATS.notes["burst: requests / choices / tokens"] = f"{BURST} / {choices} / {used}"
    STATS.notes["burst: wall time (s)"] = round(elapsed, 1)
