"""End to end: ``python -m minisgl`` on the default model, driven by the official client.

One server (session fixture) serves most tests; tests that need a differently configured or
doomed server start their own. Outputs are short (a few to a few dozen tokens) to stay fast
on two CPU cores.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.integration.conftest import MAX_QUEUED, MAX_RUNNING
from tests.server_harness import REPO, Server, parse_metrics, pid_alive, start_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
LONG_TEXT = " ".join(
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog near the river bank."
    for i in range(24)
)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


def metrics(server: Server) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)


def wait_idle(server: Server, timeout: float = 20.0) -> dict[str, float]:
    """Wait until nothing runs and every KV token is free or evictable again."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = (
            m["minisgl_num_running_requests"] == 0
            and m["minisgl_num_queued_requests"] == 0
            and m["minisgl_kv_protected_tokens"] == 0
            and m["minisgl_kv_free_tokens"] + m["minisgl_kv_evictable_tokens"]
            == m["minisgl_kv_total_tokens"]
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def stream_chat_text(client: openai.OpenAI, **kwargs) -> tuple[str, list[str], object]:
    text, finishes, usage = [], [], None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta and ch.delta.content:
                text.append(ch.delta.content)
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    return "".join(text), finishes, usage


# ---- generation --------------------------------------------------------------------------


def test_chat_greedy_answer_and_exact_usage(client: openai.OpenAI, tokenizer) -> None:
    from minisgl.tokenizer import encode_chat

    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=24)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert r.usage.prompt_tokens == len(encode_chat(tokenizer, FRANCE))
    completion_ids = tokenizer.encode(choice.message.content, add_special_tokens=False)
    assert r.usage.completion_tokens in (len(completion_ids), len(completion_ids) + 1)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(
        messages=[{"role": "user", "content": "Write one sentence about the sea."}],
        temperature=0,
        max_tokens=16,
    )
    plain = client.chat.completions.create(model=MODEL, **kwargs)
    text, finishes, usage = stream_chat_text(
        client, stream_options={"include_usage": True}, **kwargs
    )
    assert text == plain.choices[0].message.content and text
    assert finishes == [plain.choices[0].finish_reason]
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.completion_tokens == plain.usage.completion_tokens


def test_completions_forms_stream_and_usage(client: openai.OpenAI, tokenizer) -> None:
    from minisgl.tokenizer import encode_text

    prompt = "The three primary colors are"
    plain = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    assert plain.object == "text_completion"
    assert plain.usage.prompt_tokens == len(encode_text(tokenizer, prompt))
    assert plain.usage.completion_tokens == 8 and plain.choices[0].finish_reason == "length"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stream=True
        )
        if c.choices
    )
    assert streamed == plain.choices[0].text
    ids = client.completions.create(
        model=MODEL, prompt=encode_text(tokenizer, prompt), temperature=0, max_tokens=8
    )
    assert ids.choices[0].text == plain.choices[0].text
    both = client.completions.create(
        model=MODEL, prompt=[prompt, "One, two,"], temperature=0, max_tokens=6, echo=True
    )
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text.startswith(prompt)
    assert (
        both.choices[0].text[len(prompt) :]
        == plain.choices[0].text[: len(both.choices[0].text) - len(prompt)]
    )
    assert both.choices[1].text.startswith("One, two,")
    assert both.usage.prompt_tokens == len(encode_text(tokenizer, prompt)) + len(
        encode_text(tokenizer, "One, two,")
    )


def test_streamed_multibyte_text_is_never_broken(client: openai.OpenAI) -> None:
    prompt = "日本の首都は東京です。中国の首都は"
    plain = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces) == plain.choices[0].text
    assert not any("\ufffd" in p for p in pieces)
    assert any(ord(ch) > 0x2FFF for ch in plain.choices[0].text), plain.choices[0].text


def test_n_with_seed_is_reproducible(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a fruit."}],
        temperature=1.0,
        max_tokens=10,
        n=2,
        seed=1234,
    )
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert first.usage.completion_tokens == sum(second.usage.completion_tokens for _ in [0])


def test_stop_string_across_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe a sunny day at the beach."}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=24, logprobs=True
    )
    text = full.choices[0].message.content
    tokens = [t.token for t in full.choices[0].logprobs.content]
    assert "".join(tokens) == text
    k = next(
        i
        for i in range(2, len(tokens) - 1)
        if len(tokens[i].strip()) >= 2 and len(tokens[i + 1].strip()) >= 2
    )
    stop = tokens[k][-2:] + tokens[k + 1][:2]
    expected = text[: text.find(stop)]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=24, stop=[stop, "@@never@@"]
    )
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    streamed, finishes, _ = stream_chat_text(
        client, messages=messages, temperature=0, max_tokens=24, stop=stop
    )
    assert streamed == expected and finishes == ["stop"]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


def test_radix_cache_reports_cached_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": LONG_TEXT + " Summarize."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens > 300
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens // 2 < cached <= second.usage.prompt_tokens


def test_32_concurrent_streams(server: Server, client: openai.OpenAI) -> None:
    prompts = ["Count to five.", "Name a color.", "Say hello.", "What is 2+2?"]
    expected = {}
    for p in prompts:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=8
        )
        expected[p] = r.choices[0].message.content

    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)

    async def one(p: str) -> tuple[str, str, list[str]]:
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": p}],
            temperature=0,
            max_tokens=8,
            stream=True,
        )
        parts, finishes = [], []
        async for chunk in stream:
            for ch in chunk.choices:
                if ch.delta and ch.delta.content:
                    parts.append(ch.delta.content)
                if ch.finish_reason:
                    finishes.append(ch.finish_reason)
        return p, "".join(parts), finishes

    async def all_of_them() -> list[tuple[str, str, list[str]]]:
        async with aclient:
            return await asyncio.gather(*(one(prompts[i % 4]) for i in range(32)))

    results = asyncio.run(all_of_them())
    assert len(results) == 32
    for p, text, finishes in results:
        assert len(finishes) == 1
        assert text == expected[p], (p, text, expected[p])


# ---- errors ------------------------------------------------------------------------------


def assert_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return err


def test_errors_and_recovery(server: Server, client: openai.OpenAI) -> None:
    url = f"{server.url}/v1/chat/completions"
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 3, "temperature": 0}
    h = server.headers

    def still_ok() -> None:
        r = httpx.post(url, json=body, headers=h, timeout=60)
        assert r.status_code == 200, r.text

    err = assert_error(httpx.post(url, json={**body, "temperature": "hot"}, headers=h), 400)
    assert err["param"] == "temperature"
    still_ok()
    assert_error(httpx.post(url, content=b"{nope", headers=h), 400)
    still_ok()
    err = assert_error(
        httpx.post(url, json={**body, "max_tokens": 9000}, headers=h),
        400,
        "context_length_exceeded",
    )
    prompt_tokens = client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=1
    ).usage.prompt_tokens
    assert "8192" in err["message"] and str(prompt_tokens + 9000) in err["message"]
    assert str(prompt_tokens) in err["message"] and "9000" in err["message"]
    r = httpx.post(url, json={**body, "max_tokens": 9000, "stream": True}, headers=h)
    assert_error(r, 400, "context_length_exceeded")
    still_ok()
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-17", messages=FRANCE, max_tokens=2)
    assert nf.value.status_code == 404 and nf.value.code == "model_not_found"
    still_ok()
    assert_error(httpx.post(url, json=body), 401, "invalid_api_key")
    assert_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    still_ok()
    huge = {**body, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    assert_error(httpx.post(url, json=huge, headers=h, timeout=60), 413)
    still_ok()
    assert_error(httpx.post(url, json={**body, "n": MAX_RUNNING + MAX_QUEUED + 1}, headers=h), 503)
    still_ok()
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{server.url}/v1/models", headers=h).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_abort_endpoint(server: Server) -> None:
    url = f"{server.url}/v1/chat/completions"
    body = {
        "model": MODEL,
        "messages": FRANCE,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", url, json=body, headers=server.headers, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line)
        first = next(lines)
        rid = re.search(r'"id": ?"([^"]+)"', first).group(1)
        resp = httpx.post(f"{server.url}/abort", json={"id": rid}, headers=server.headers)
        assert resp.status_code == 200 and resp.json()["aborted"] == [f"{rid}-0"]
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    assert '"finish_reason": "abort"' in rest[-2] or '"finish_reason":"abort"' in rest[-2]
    assert len(rest) < 500


def test_client_disconnect_frees_kv(server: Server) -> None:
    before = wait_idle(server)
    url = f"{server.url}/v1/chat/completions"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": LONG_TEXT}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", url, json=body, headers=server.headers, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    during = metrics(server)
    after = wait_idle(server)
    assert after["minisgl_kv_protected_tokens"] == 0
    assert (
        after["minisgl_kv_free_tokens"] + after["minisgl_kv_evictable_tokens"]
        == (after["minisgl_kv_total_tokens"])
    )
    assert after["minisgl_num_running_requests"] == 0
    aborted = 'minisgl_requests_total{finish_reason="abort"}'
    assert after[aborted] == before[aborted] + 1
    generated = after["minisgl_generation_tokens_total"] - before["minisgl_generation_tokens_total"]
    assert generated < 3000
    assert during["minisgl_kv_total_tokens"] == after["minisgl_kv_total_tokens"]


def test_metrics_names(server: Server) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "minisgl_num_running_requests",
        "minisgl_num_queued_requests",
        "minisgl_kv_total_tokens",
        "minisgl_kv_free_tokens",
        "minisgl_kv_evictable_tokens",
        "minisgl_kv_protected_tokens",
        "minisgl_prompt_tokens_total",
        "minisgl_cached_prompt_tokens_total",
        "minisgl_generation_tokens_total",
        "minisgl_retractions_total",
    ):
        assert re.search(rf"^{name} \d", text, re.M), name
    assert re.search(r'^minisgl_requests_total\{finish_reason="stop"\} [1-9]', text, re.M)
    assert re.search(r"^minisgl_time_to_first_token_seconds_count [1-9]", text, re.M)
    assert re.search(r"^minisgl_time_per_output_token_seconds_count [1-9]", text, re.M)
    m = metrics(server)
    assert m["minisgl_kv_total_tokens"] == 16384


# ---- other servers and lifecycle ---------------------------------------------------------


def test_help_documents_every_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0
    for flag in (
        "--model",
        "--cache",
        "--host",
        "--port",
        "--tp",
        "--device",
        "--dtype",
        "--page-size",
        "--num-pages",
        "--memory-ratio",
        "--max-running-requests",
        "--max-prefill-length",
        "--attn",
        "--served-model-name",
        "--api-key",
        "--shell",
        "--log-level",
        "--max-queued-requests",
    ):
        assert flag in out.stdout, flag


def test_startup_failure_is_reported() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", "/nonexistent/model-dir", "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode != 0
    assert "scheduler-0 failed to start" in out.stderr
    assert "/nonexistent/model-dir" in out.stderr


def test_naive_cache_and_worker_death() -> None:
    srv = start_server("--cache", "naive", "--num-pages", "4096", name="naive")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": LONG_TEXT + " Summarize."}]
        for _ in range(2):
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
            assert r.usage.prompt_tokens_details.cached_tokens == 0
        workers = srv.workers()
        assert sorted(workers.values()) == ["minisgl-detok", "minisgl-sched-0", "minisgl-tok"]
        (sched,) = [p for p, name in workers.items() if name == "minisgl-sched-0"]
        os.kill(sched, signal.SIGKILL)
        saw_503 = False
        deadline = time.monotonic() + 15
        while srv.proc.poll() is None and time.monotonic() < deadline:
            try:
                saw_503 |= httpx.get(f"{srv.url}/health", timeout=1).status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert srv.proc.wait(15) != 0
        assert saw_503
        assert "scheduler-0 died" in srv.log()
        time.sleep(0.5)
        assert not any(pid_alive(p) for p in workers)
    finally:
        srv.stop()


def test_sigterm_ends_streams_and_all_processes(server: Server) -> None:
    """Runs last: it stops the session's server (the fixture's teardown then has nothing to do)."""
    workers = server.workers()
    assert sorted(workers.values()) == ["minisgl-detok", "minisgl-sched-0", "minisgl-tok"]
    body = {
        "model": MODEL,
        "messages": FRANCE,
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    url = f"{server.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=server.headers, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest and rest[-1] == "data: [DONE]"
    assert '"finish_reason": "abort"' in rest[-2]
    assert server.proc.wait(15) == 0
    assert time.monotonic() - t0 < 10
    time.sleep(0.2)
    assert not any(pid_alive(p) for p in workers)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=2)
