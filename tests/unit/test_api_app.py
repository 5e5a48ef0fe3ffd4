"""The HTTP app against an in-process fake backend: response shapes, SSE, errors, aborts.

The fake backend answers each choice with ``max_tokens`` words ``w0 w1 ...`` (one token
each, a short pause between them), so shapes, streaming order, usage sums, disconnects and
error mapping can be checked in milliseconds. The real pipeline is covered end to end by
tests/integration/test_server_openai.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from minisgl.message import AbortMsg, AcceptedMsg, ErrorInfo, Reply, TokenizeMsg, TokenLogprob
from minisgl.server.api import ApiSettings, create_app
from minisgl.server.backend import Backend

MODEL = "fake-model"
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeBackend(Backend):
    def __init__(self, max_inflight: int | None = None, delay: float = 0.001) -> None:
        super().__init__(max_inflight)
        self.set_ready({"max_seq_len": 100})
        self.delay = delay
        self.sent: list[object] = []
        self.aborted: list[str] = []
        self._tasks: dict[str, asyncio.Task] = {}

    def _send(self, msg: object, data: bytes) -> None:
        self.sent.append(msg)
        if isinstance(msg, AbortMsg):
            for rid in msg.rids:
                self.aborted.append(rid)
                task = self._tasks.pop(rid, None)
                if task is not None:
                    task.cancel()
                    self.deliver(Reply(rid, finished=True, finish_reason="abort"))
        elif isinstance(msg, TokenizeMsg):
            for rid, params in zip(msg.rids, msg.params, strict=True):
                task = asyncio.get_running_loop().create_task(self._generate(msg, rid, params))
                self._tasks[rid] = task

    async def _generate(self, msg: TokenizeMsg, rid: str, params: Any) -> None:
        prompt = msg.text or json.dumps(msg.messages) or " ".join(map(str, msg.input_ids or []))
        if "TOO_LONG" in prompt:
            info = ErrorInfo("too long", code="context_length_exceeded", param="messages")
            self.deliver(Reply(rid, finished=True, finish_reason="error", error=info))
            return
        prompt_tokens = len(prompt.split())
        self.deliver(AcceptedMsg(rid, prompt_tokens, prompt if msg.echo else None))
        n = 5 if msg.fill_max_tokens else params.max_tokens
        for i in range(n):
            await asyncio.sleep(self.delay)
            lp = None
            if params.logprobs is not None:
                top = [(f"w{i}", -0.5), ("x", -1.5)][: params.logprobs]
                lp = [TokenLogprob(i, f"w{i} ", -0.5, top)]
            last = i == n - 1
            self.deliver(
                Reply(
                    rid,
                    text=f"w{i} ",
                    num_tokens=1,
                    logprobs=lp,
                    finished=last,
                    finish_reason="length" if last else None,
                    prompt_tokens=prompt_tokens,
                    cached_tokens=1 if params.seed else 0,
                )
            )
        self._tasks.pop(rid, None)


def make_client(backend: Backend, **settings: Any) -> httpx.AsyncClient:
    cfg = ApiSettings(MODEL, frozenset({MODEL}), **settings)
    app = create_app(backend, cfg)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


def sse_events(text: str) -> list[Any]:
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(resp: httpx.Response, status: int, code: str | None = None, param=None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


async def test_chat_completion_shape() -> None:
    async with make_client(FakeBackend()) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": "w0 w1 w2 "},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert body["usage"] == {
        "prompt_tokens": len(json.dumps(CHAT["messages"]).split()),
        "completion_tokens": 3,
        "total_tokens": len(json.dumps(CHAT["messages"]).split()) + 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_stream_matches_non_stream_and_ends_with_done() -> None:
    async with make_client(FakeBackend()) as c:
        plain = (await c.post("/v1/chat/completions", json=CHAT)).json()
        r = await c.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["object"] == "chat.completion.chunk" for e in chunks)
    assert len({e["id"] for e in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(
        ch["delta"].get("content", "") for e in chunks for ch in e["choices"] if ch["delta"]
    )
    assert text == plain["choices"][0]["message"]["content"]
    finishes = [ch["finish_reason"] for e in chunks for ch in e["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == plain["usage"]
    assert all(e["usage"] is None for e in chunks[:-1])


async def test_n_choices_and_seeds() -> None:
    backend = FakeBackend()
    async with make_client(backend) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 7})
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 9
    (msg,) = [m for m in backend.sent if isinstance(m, TokenizeMsg)]
    assert [p.seed for p in msg.params] == [7, 8, 9] and len(msg.rids) == 3
    assert not msg.fill_max_tokens


async def test_streamed_n_choices_each_finish_once() -> None:
    async with make_client(FakeBackend()) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "n": 2, "stream": True})
    chunks = sse_events(r.text)[:-1]
    for index in (0, 1):
        mine = [ch for e in chunks for ch in e["choices"] if ch["index"] == index]
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]
        assert "".join(ch["delta"].get("content", "") for ch in mine) == "w0 w1 w2 "


async def test_completions_prompt_forms_echo_and_logprobs() -> None:
    backend = FakeBackend()
    async with make_client(backend) as c:
        r = await c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": ["a b", "c"], "n": 2, "max_tokens": 2, "echo": True},
        )
        body = r.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        texts = [ch["text"] for ch in body["choices"]]
        assert texts == ["a bw0 w1 ", "a bw0 w1 ", "cw0 w1 ", "cw0 w1 "]
        assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 8
        r = await c.post(
            "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 1}
        )
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["tokens"] == ["w0 ", "w1 "] and lp["token_logprobs"] == [-0.5, -0.5]
        assert lp["top_logprobs"] == [{"w0": -0.5}, {"w1": -0.5}]
        assert lp["text_offset"] == [0, 3]
        ids = [m.input_ids for m in backend.sent if isinstance(m, TokenizeMsg)]
        assert ids[-1] == [1, 2, 3]
        r = await c.post(
            "/v1/completions", json={"prompt": "p", "max_tokens": 2, "stream": True, "echo": True}
        )
        chunks = sse_events(r.text)[:-1]
        assert "".join(e["choices"][0]["text"] for e in chunks) == "pw0 w1 "


async def test_chat_logprobs_shape() -> None:
    async with make_client(FakeBackend()) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert content[0] == {
        "token": "w0 ",
        "logprob": -0.5,
        "bytes": list(b"w0 "),
        "top_logprobs": [
            {"token": "w0", "logprob": -0.5, "bytes": list(b"w0")},
            {"token": "x", "logprob": -1.5, "bytes": list(b"x")},
        ],
    }


async def test_missing_max_tokens_fills_the_context() -> None:
    backend = FakeBackend()
    async with make_client(backend) as c:
        body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
        r = await c.post("/v1/chat/completions", json=body)
    assert r.json()["usage"]["completion_tokens"] == 5
    assert [m for m in backend.sent if isinstance(m, TokenizeMsg)][0].fill_max_tokens


async def test_validation_errors_are_400_never_422() -> None:
    async with make_client(FakeBackend()) as c:
        assert_error(await c.post("/v1/chat/completions", content=b"{oops"), 400)
        assert_error(
            await c.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"}),
            400,
            param="temperature",
        )
        assert_error(
            await c.post("/v1/chat/completions", json={"model": MODEL}), 400, param="messages"
        )
        assert_error(await c.post("/v1/chat/completions", json={**CHAT, "n": 0}), 400, param="n")
        assert_error(await c.post("/v1/completions", json={"prompt": {}}), 400, param="prompt")
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "CANARY" * 1000})
        assert_error(r, 404, "model_not_found")
        assert "CANARY" not in r.text and len(r.content) < 1000
        r = await c.post("/v1/chat/completions", json={**CHAT, "unknown_field": [1]})
        assert r.status_code == 200
        for ctype in ("text/plain", "application/x-www-form-urlencoded"):
            r = await c.post(
                "/v1/chat/completions", content=json.dumps(CHAT), headers={"content-type": ctype}
            )
            assert_error(r, 400, param="content-type")
        for ctype in ("application/json; charset=utf-8", None):
            headers = {"content-type": ctype} if ctype else {}
            r = await c.post("/v1/chat/completions", content=json.dumps(CHAT), headers=headers)
            assert r.status_code == 200, ctype


async def test_model_auth_size_and_route_errors() -> None:
    async with make_client(FakeBackend(), api_key="sekret", max_body_bytes=2000) as c:
        auth = {"Authorization": "Bearer sekret"}
        assert_error(await c.post("/v1/chat/completions", json=CHAT), 401, "invalid_api_key")
        assert_error(
            await c.post(
                "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"}
            ),
            401,
        )
        assert_error(await c.get("/v1/models"), 401)
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
        assert_error(
            await c.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}, headers=auth),
            404,
            "model_not_found",
            "model",
        )
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        assert_error(await c.post("/v1/chat/completions", json=big, headers=auth), 413)

        async def chunked():
            for _ in range(10):
                yield b" " * 500

        r = await c.post("/v1/chat/completions", content=chunked(), headers=auth)
        assert_error(r, 413)
        assert_error(await c.get("/v1/nothing", headers=auth), 404)
        assert_error(await c.get("/v1/chat/completions", headers=auth), 405)
        r = await c.post("/v1/chat/completions", json=CHAT, headers=auth)
        assert r.status_code == 200
        models = (await c.get("/v1/models", headers=auth)).json()
        assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 100


async def test_backend_errors_map_to_status_before_streaming() -> None:
    too_long = {**CHAT, "messages": [{"role": "user", "content": "TOO_LONG"}]}
    async with make_client(FakeBackend()) as c:
        for stream in (False, True):
            r = await c.post("/v1/chat/completions", json={**too_long, "stream": stream})
            assert_error(r, 400, "context_length_exceeded")
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_overload_is_503_and_recovers() -> None:
    backend = FakeBackend(max_inflight=2, delay=0.05)
    async with make_client(backend) as c:
        first = asyncio.ensure_future(c.post("/v1/chat/completions", json={**CHAT, "n": 2}))
        await asyncio.sleep(0.02)
        assert_error(await c.post("/v1/chat/completions", json=CHAT), 503, "server_overloaded")
        assert (await first).status_code == 200
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_unhealthy_backend_answers_503_and_ends_requests() -> None:
    backend = FakeBackend(delay=0.05)
    async with make_client(backend) as c:
        pending = asyncio.ensure_future(
            c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 50})
        )
        await asyncio.sleep(0.1)
        backend.fail("scheduler-0 exited with code 1: boom")
        assert_error(await pending, 503)
        assert_error(await c.get("/health"), 503)
        assert_error(await c.post("/v1/chat/completions", json=CHAT), 503)


async def test_starting_backend_answers_503_starting() -> None:
    backend = FakeBackend()
    backend.facts = None
    async with make_client(backend) as c:
        assert_error(await c.get("/health"), 503, "starting")
        assert_error(await c.post("/v1/chat/completions", json=CHAT), 503, "starting")
        assert "max_model_len" not in (await c.get("/v1/models")).json()["data"][0]
        backend.set_ready({"max_seq_len": 100})
        assert (await c.get("/health")).status_code == 200
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_shutting_down_refuses_new_requests_and_aborts_old_ones() -> None:
    backend = FakeBackend(delay=0.02)
    async with make_client(backend) as c:
        pending = asyncio.ensure_future(
            c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1000})
        )
        while not backend.num_inflight:
            await asyncio.sleep(0.01)
        backend.shut_down()
        assert (await pending).json()["choices"][0]["finish_reason"] == "abort"
        assert_error(await c.post("/v1/chat/completions", json=CHAT), 503, "shutting_down")
        assert_error(await c.get("/health"), 503, "shutting_down")


async def test_abort_endpoint_ends_a_request_with_abort() -> None:
    backend = FakeBackend(delay=0.02)
    async with make_client(backend) as c:
        pending = asyncio.ensure_future(
            c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1000, "n": 2})
        )
        while not backend.sent:
            await asyncio.sleep(0.01)
        rid = backend.sent[0].rids[0]
        response_id = rid.rsplit("-", 1)[0]
        resp = await c.post("/abort", json={"id": response_id})
        assert sorted(resp.json()["aborted"]) == [f"{response_id}-0", f"{response_id}-1"]
        body = (await pending).json()
        assert body["id"] == response_id
        assert [ch["finish_reason"] for ch in body["choices"]] == ["abort", "abort"]
        assert body["usage"]["completion_tokens"] < 2000
        assert_error(await c.post("/abort", json={"id": response_id}), 404, "request_not_found")
        assert_error(await c.post("/abort", json={}), 400)


async def _run_asgi_until_disconnect(app: Any, body: dict, chunks_before: int) -> list[dict]:
    """Drive the ASGI app by hand: read a few body chunks, then report a disconnect."""
    data = json.dumps(body).encode()
    sent: list[dict] = []
    got_chunks = asyncio.Event()
    if chunks_before == 0:
        got_chunks.set()
    request_sent = False

    async def receive() -> dict:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await got_chunks.wait()
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if sum(m["type"] == "http.response.body" for m in sent) >= chunks_before:
            got_chunks.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"t")],
        "client": ("127.0.0.1", 1),
        "server": ("t", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    return sent


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts(stream: bool) -> None:
    backend = FakeBackend(delay=0.01)
    app = create_app(backend, ApiSettings(MODEL, frozenset({MODEL})))
    body = {**CHAT, "max_tokens": 10_000, "stream": stream}
    await _run_asgi_until_disconnect(app, body, chunks_before=3 if stream else 0)
    await asyncio.sleep(0.05)
    assert len(backend.aborted) == 1
    assert backend.num_inflight == 0
    assert backend.metrics.requests_total["abort"] == 1


async def test_metrics_text() -> None:
    backend = FakeBackend()
    async with make_client(backend) as c:
        await c.post("/v1/chat/completions", json={**CHAT, "n": 2, "seed": 1})
        text = (await c.get("/metrics")).text
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
        assert f"\n{name} " in text, name
    assert 'minisgl_requests_total{finish_reason="length"} 2' in text
    assert "minisgl_generation_tokens_total 6" in text
    assert "minisgl_cached_prompt_tokens_total 2" in text
    assert 'minisgl_time_to_first_token_seconds_bucket{le="+Inf"} 2' in text
    assert "minisgl_time_to_first_token_seconds_count 2" in text
    assert "minisgl_time_per_output_token_seconds_count 2" in text
    assert "# TYPE minisgl_time_per_output_token_seconds histogram" in text


async def test_shell_streams_keeps_history_and_resets() -> None:
    import io

    from minisgl.server.args import ServerArgs
    from minisgl.server.shell import MAX_REPLY_TOKENS, Shell

    backend = FakeBackend()
    out = io.StringIO()
    shell = Shell(backend, ServerArgs(), out=out)
    assert await shell.command("hello")
    assert await shell.command("again")
    (first, second) = [m for m in backend.sent if isinstance(m, TokenizeMsg)]
    reply = "".join(f"w{i} " for i in range(MAX_REPLY_TOKENS))
    assert first.messages == [{"role": "user", "content": "hello"}]
    assert second.messages == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "again"},
    ]
    assert out.getvalue() == f"{reply}\n{reply}\n"
    assert await shell.command("/reset") and shell.history == []
    assert not await shell.command("/exit")
    assert out.getvalue().endswith("(conversation cleared)\n")


async def test_unencodable_request_is_400_and_leaves_nothing_in_flight() -> None:
    from minisgl.sampling_params import SamplingParams
    from minisgl.server.errors import ApiError

    backend = FakeBackend()
    msg = TokenizeMsg(rids=["x-0"], params=[SamplingParams()], input_ids=[1, 2**70])
    with pytest.raises(ApiError) as info:
        await backend.submit(msg, "x", asyncio.Queue())
    assert info.value.status == 400
    assert backend.num_inflight == 0 and backend.sent == []
