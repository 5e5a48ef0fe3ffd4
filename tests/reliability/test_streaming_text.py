"""Streamed text: emoji and CJK never break, stop strings never leak, immediate stops are empty.

All generations are greedy, so a streamed run must reproduce the non-streamed one exactly;
stop-string expectations are derived from an unstopped reference run of the same request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.reliability.support import MODEL, Outcome, http_client, request, wait_idle
from tests.server_harness import Server

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
REPLACEMENT = "\ufffd"

MULTIBYTE_PROMPTS = {
    "emoji_completion": (COMPLETIONS, "🙂😀🎉🙂😀🎉🙂😀🎉🙂😀🎉"),
    "cjk_completion": (COMPLETIONS, "中文测试，我们今天去北京。中文测试，我们今天去北京。中文"),
    "japanese_completion": (COMPLETIONS, "日本語の文章：東京は日本の首都です。東京は"),
    "emoji_chat": (CHAT, "Reply with only emoji: 🎉🎉🎉"),
    "cjk_chat": (CHAT, "请用中文介绍一下北京。"),
    "mixed_chat": (CHAT, "Translate 'good morning' into Chinese and Japanese."),
}


@pytest.fixture(scope="module")
def http(main_server: Server) -> Iterator[httpx.Client]:
    with http_client(base_url=main_server.url, headers=main_server.headers) as c:
        yield c


def body_for(path: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 16, **extra}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


_references: dict[tuple[str, str, str], Outcome] = {}


def generate(http: httpx.Client, path: str, prompt: str, **extra: Any) -> Outcome:
    out = request(http, path, body_for(path, prompt, **extra))
    assert out.status == 200, out.errors
    if extra.get("stream"):
        assert out.done, "stream did not end with [DONE]"
        assert not out.errors, out.errors
        for i, finishes in out.finishes.items():
            assert len(finishes) == 1, (i, finishes)
    return out


def reference(http: httpx.Client, path: str, prompt: str, **extra: Any) -> Outcome:
    """A non-streamed greedy run, generated once per module and server."""
    key = (str(http.base_url), path, prompt + repr(sorted(extra.items())))
    if key not in _references:
        _references[key] = generate(http, path, prompt, **extra)
    return _references[key]


def assert_clean(out: Outcome, index: int = 0) -> None:
    """No U+FFFD, except a last character cut by max_tokens (the model stopped mid-char)."""
    text = out.text(index)
    body = text[:-1] if out.finish(index) == "length" else text
    assert REPLACEMENT not in body, repr(text)
    for piece in out.deltas.get(index, [])[:-1]:
        assert REPLACEMENT not in piece, (piece, out.deltas[index])


@pytest.mark.parametrize("name", sorted(MULTIBYTE_PROMPTS))
def test_stream_equals_text_for_multibyte_output(http: httpx.Client, name: str) -> None:
    path, prompt = MULTIBYTE_PROMPTS[name]
    plain = reference(http, path, prompt)
    streamed = generate(http, path, prompt, stream=True)
    text = plain.text()
    assert any(ord(c) > 0x2E80 for c in text), f"no multibyte output to test: {text!r}"
    assert "".join(streamed.deltas.get(0, [])) == text
    assert streamed.finish() == plain.finish()
    assert_clean(plain)
    assert_clean(streamed)


def test_stream_with_n_choices_equals_text(http: httpx.Client) -> None:
    path, prompt = MULTIBYTE_PROMPTS["cjk_completion"]
    plain = generate(http, path, prompt, n=3)
    streamed = generate(http, path, prompt, n=3, stream=True)
    assert sorted(plain.texts) == sorted(streamed.texts) == [0, 1, 2]
    for i in range(3):
        assert streamed.text(i) == plain.text(i) == plain.text(0)
        assert_clean(streamed, i)


def spanning_stop(tokens: list[str]) -> str:
    """Two characters of one token's end and two of the next one's start."""
    for i in range(2, len(tokens) - 1):
        a, b = tokens[i], tokens[i + 1]
        if len(a.strip()) >= 2 and len(b.strip()) >= 2 and REPLACEMENT not in a + b:
            return a[-2:] + b[:2]
    pytest.fail(f"no pair of tokens to span: {tokens}")


STOP_CASES = {
    "ascii_chat": (CHAT, "Describe a sunny day at the beach."),
    "ascii_completion": (COMPLETIONS, "The old lighthouse keeper climbed the stairs and"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("name", sorted(STOP_CASES))
def test_stop_spanning_tokens_is_never_streamed_in_part(
    http: httpx.Client, name: str, stream: bool
) -> None:
    path, prompt = STOP_CASES[name]
    logprobs = {"logprobs": True} if path == CHAT else {"logprobs": 0}
    ref = reference(http, path, prompt, max_tokens=24, **logprobs)
    assert ref.body is not None
    lp = ref.body["choices"][0]["logprobs"]
    tokens = [t["token"] for t in lp["content"]] if path == CHAT else lp["tokens"]
    text = ref.text()
    assert "".join(tokens) == text
    stop = spanning_stop(tokens)
    expected = text[: text.find(stop)]
    out = generate(http, path, prompt, max_tokens=24, stop=[stop, "@@never@@"], stream=stream)
    assert out.text() == expected
    assert out.finish() == "stop"
    if stream:
        assert "".join(out.deltas.get(0, [])) == expected


MULTIBYTE_STOPS = {
    "cjk_pair": ("cjk_completion", lambda t: t[4:6]),
    "emoji": ("emoji_completion", lambda t: t[2]),
    "cjk_chat_word": ("cjk_chat", lambda t: t[t.index("北") : t.index("北") + 2]),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("case", sorted(MULTIBYTE_STOPS))
def test_multibyte_stop_strings(http: httpx.Client, case: str, stream: bool) -> None:
    name, pick = MULTIBYTE_STOPS[case]
    path, prompt = MULTIBYTE_PROMPTS[name]
    text = reference(http, path, prompt).text()
    stop = pick(text)
    assert stop and REPLACEMENT not in stop, (stop, text)
    expected = text[: text.find(stop)]
    out = generate(http, path, prompt, stop=stop, stream=stream)
    assert out.text() == expected and out.finish() == "stop"
    assert REPLACEMENT not in out.text()
    assert_clean(out)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_unmatched_stop_prefixes_are_released(http: httpx.Client, path: str, stream: bool) -> None:
    """Text held back because it might start a stop string is released when the stop string
    never completes: mid-text and at the very end of the output."""
    prompt = "Write one sentence about the sea." if path == CHAT else "Once upon a time, a fox"
    ref = reference(http, path, prompt, max_tokens=16)
    text = ref.text()
    assert len(text) > 8 and ref.finish() == "length"
    stops = [text[3:6] + "\x01#", text[-2:] + "\x01never", text[-1] + "\x02"]
    out = generate(http, path, prompt, max_tokens=16, stop=stops, stream=stream)
    assert out.text() == text
    assert out.finish() == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_immediate_stop_gives_empty_content(http: httpx.Client, path: str, stream: bool) -> None:
    prompt = "Say hello." if path == CHAT else "Hello, my name is"
    text = reference(http, path, prompt, max_tokens=8).text()
    assert text.strip(), text
    for stop in (text[:1], text[:3], text):
        out = generate(http, path, prompt, max_tokens=8, stop=stop, stream=stream)
        assert out.text() == "", (stop, out.text())
        assert out.finish() == "stop"
        assert not any(out.deltas.get(0, [])), out.deltas


def test_streaming_left_nothing_behind(main_server: Server) -> None:
    wait_idle(main_server, timeout=20)
