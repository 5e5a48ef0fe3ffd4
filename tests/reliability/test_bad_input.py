"""Bad input: every client mistake is a small 400/401/404/413 in OpenAI's error shape.

Each bad body carries a canary string somewhere else in the request; the error must name the
offending field, fit in a small body, hold no traceback and never echo the canary back.
The module ends by checking that none of the refused requests left anything behind.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.reliability.conftest import MAIN_MAX_BODY, MAIN_MAX_SEQ_LEN
from tests.reliability.support import MODEL, http_client, read_metrics, wait_idle
from tests.server_harness import Server

pytestmark = pytest.mark.slow

CANARY = "CANARY-7f3a9c-do-not-echo"
MAX_ERROR_BYTES = 2048
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
VOCAB = 49152
DROP = object()


@pytest.fixture(scope="module")
def http(main_server: Server) -> Iterator[httpx.Client]:
    with http_client(base_url=main_server.url, headers=main_server.headers) as c:
        yield c


def with_fields(body: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """``body`` with ``fields`` set, or removed where the value is ``DROP``."""
    body = {**body, **fields}
    return {k: v for k, v in body.items() if v is not DROP}


def chat_body(**fields: Any) -> dict[str, Any]:
    base = {"model": MODEL, "messages": [{"role": "user", "content": CANARY}], "max_tokens": 2}
    return with_fields(base, fields)


def completion_body(**fields: Any) -> dict[str, Any]:
    return with_fields({"model": MODEL, "prompt": CANARY, "max_tokens": 2}, fields)


def check_error(
    resp: httpx.Response, status: int, field: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape, small, no traceback, naming ``field``, without the canary."""
    assert resp.status_code == status, resp.text[:500]
    assert resp.headers["content-type"].startswith("application/json")
    assert len(resp.content) <= MAX_ERROR_BYTES, f"{len(resp.content)} bytes: {resp.text[:300]}"
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip()
    assert isinstance(err["type"], str) and err["type"]
    assert "Traceback" not in resp.text and 'File "' not in resp.text
    assert CANARY not in resp.text
    if status == 400:
        assert err["type"] == "invalid_request_error"
    if field is not None:
        assert field in err["message"], (field, err)
    if code is not None:
        assert err["code"] == code, err
    return err


def post_json(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


# ---- 1. bodies that are not a valid JSON object ------------------------------------------


def raw_chat(content: bytes, tail: bytes = b', "max_tokens": 2') -> bytes:
    """A chat body with ``content`` spliced in as raw bytes (already quoted)."""
    return b'{"messages": [{"role": "user", "content": ' + content + b"}]" + tail + b"}"


RAW_BODIES = {
    "truncated_json": raw_chat(b'"' + CANARY.encode())[:-30],
    "trailing_garbage": json.dumps(chat_body()).encode() + b"}}",
    "single_quotes": raw_chat(b"'" + CANARY.encode() + b"'"),
    "array_body": b'[{"role": "user", "content": "' + CANARY.encode() + b'"}]',
    "string_body": b'"' + CANARY.encode() + b'"',
    "number_body": b"42",
    "null_body": b"null",
    "empty_body": b"",
    "invalid_utf8": raw_chat(b'"\xff\xfe\xfd"'),
    "overlong_utf8": raw_chat(b'"\xc0\xaf"'),
    "lone_high_surrogate": raw_chat(b'"a\\ud800b"'),
    "lone_low_surrogate": raw_chat(b'"ok"', b', "stop": "\\udc00"'),
    "deep_nesting": b'{"messages": ' + b"[" * 20000 + b"]" * 20000 + b"}",
}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("name", sorted(RAW_BODIES))
def test_unparseable_body_is_400(http: httpx.Client, path: str, name: str) -> None:
    resp = http.post(path, content=RAW_BODIES[name], headers={"Content-Type": "application/json"})
    check_error(resp, 400)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
def test_wrong_content_type_is_400(http: httpx.Client, content_type: str) -> None:
    resp = http.post(CHAT, content=json.dumps(chat_body()), headers={"Content-Type": content_type})
    err = check_error(resp, 400)
    assert "content-type" in err["message"].lower()


# ---- 1./2. fields missing, mistyped or out of range -----------------------------------------

CHAT_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "messages_missing": ({"messages": DROP}, "messages"),
    "messages_string": ({"messages": CANARY}, "messages"),
    "messages_object": ({"messages": {"role": "user", "content": CANARY}}, "messages"),
    "messages_empty": ({"messages": []}, "messages"),
    "message_not_object": ({"messages": [CANARY]}, "messages[0]"),
    "role_unknown": ({"messages": [{"role": "wizard", "content": CANARY}]}, "role"),
    "role_missing": ({"messages": [{"content": CANARY}]}, "role"),
    "role_number": ({"messages": [{"role": 1, "content": CANARY}]}, "role"),
    "content_number": ({"messages": [{"role": "user", "content": 5}]}, "content"),
    "content_object": ({"messages": [{"role": "user", "content": {"text": CANARY}}]}, "content"),
    "content_list_of_strings": ({"messages": [{"role": "user", "content": [CANARY]}]}, "content"),
    "content_part_image": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": CANARY}}],
                }
            ]
        },
        "content",
    ),
    "content_part_no_text": (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "text",
    ),
    "content_part_text_number": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]},
        "content",
    ),
    "content_part_no_type": (
        {"messages": [{"role": "user", "content": [{"text": CANARY}]}]},
        "content",
    ),
    "content_missing": ({"messages": [{"role": "user"}]}, "content"),
    "model_number": ({"model": 7}, "model"),
    "stop_number": ({"stop": 3}, "stop"),
    "stop_list_of_numbers": ({"stop": [1, 2]}, "stop"),
    "stop_empty_string": ({"stop": ""}, "stop"),
    "stop_too_many": ({"stop": [f"s{i}" for i in range(200)]}, "stop"),
    "stop_object": ({"stop": {"a": CANARY}}, "stop"),
    "max_tokens_zero": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens_negative": ({"max_tokens": -5}, "max_tokens"),
    "max_tokens_string": ({"max_tokens": "5"}, "max_tokens"),
    "max_tokens_float": ({"max_tokens": 1.5}, "max_tokens"),
    "max_tokens_bool": ({"max_tokens": True}, "max_tokens"),
    "max_completion_tokens_zero": ({"max_completion_tokens": 0}, "max_completion_tokens"),
    "temperature_negative": ({"temperature": -0.5}, "temperature"),
    "temperature_huge": ({"temperature": 1e308}, "temperature"),
    "temperature_string": ({"temperature": "hot"}, "temperature"),
    "top_p_zero": ({"top_p": 0}, "top_p"),
    "top_p_over_one": ({"top_p": 1.0001}, "top_p"),
    "top_p_negative": ({"top_p": -0.2}, "top_p"),
    "top_k_minus_two": ({"top_k": -2}, "top_k"),
    "top_k_float": ({"top_k": 2.5}, "top_k"),
    "min_p_over_one": ({"min_p": 1.5}, "min_p"),
    "presence_penalty_high": ({"presence_penalty": 2.5}, "presence_penalty"),
    "frequency_penalty_low": ({"frequency_penalty": -2.5}, "frequency_penalty"),
    "repetition_penalty_zero": ({"repetition_penalty": 0}, "repetition_penalty"),
    "repetition_penalty_negative": ({"repetition_penalty": -1}, "repetition_penalty"),
    "n_zero": ({"n": 0}, "n"),
    "n_negative": ({"n": -3}, "n"),
    "n_absurd": ({"n": 10**9}, "n"),
    "n_beyond_int64": ({"n": 10**30}, "n"),
    "top_logprobs_over_limit": ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "top_logprobs_negative": ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    "top_logprobs_without_logprobs": ({"top_logprobs": 2}, "top_logprobs"),
    "logprobs_number": ({"logprobs": 5}, "logprobs"),
    "seed_over_int64": ({"seed": 2**63}, "seed"),
    "seed_under_int64": ({"seed": -(2**63) - 1}, "seed"),
    "seed_huge": ({"seed": 10**40}, "seed"),
    "seed_float": ({"seed": 1.5}, "seed"),
    "stream_options_without_stream": ({"stream_options": {"include_usage": True}}, "stream"),
    "stream_options_stream_false": (
        {"stream": False, "stream_options": {"include_usage": True}},
        "stream",
    ),
    "stream_string": ({"stream": "yes"}, "stream"),
    "min_tokens_over_max": ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    "min_tokens_negative": ({"min_tokens": -1}, "min_tokens"),
    "stop_token_ids_negative": ({"stop_token_ids": [-1]}, "stop_token_ids"),
    "stop_token_ids_beyond_int64": ({"stop_token_ids": [2**70]}, "stop_token_ids"),
    "max_tokens_beyond_int64": ({"max_tokens": 2**70}, "max_tokens"),
    "ignore_eos_string": ({"ignore_eos": "true"}, "ignore_eos"),
    "top_k_beyond_int64": ({"top_k": 2**70}, "top_k"),
    "content_part_type_huge": (
        {"messages": [{"role": "user", "content": [{"type": "x" * 20000, "text": CANARY}]}]},
        "content",
    ),
}


@pytest.mark.parametrize("name", sorted(CHAT_CASES))
def test_chat_field_errors_are_400(http: httpx.Client, name: str) -> None:
    fields, field = CHAT_CASES[name]
    check_error(post_json(http, CHAT, chat_body(**fields)), 400, field)


def test_nan_and_infinity_literals_are_400(http: httpx.Client) -> None:
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + literal + b"}"
        resp = http.post(CHAT, content=body, headers={"Content-Type": "application/json"})
        check_error(resp, 400)


COMPLETION_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "prompt_missing": ({"prompt": DROP}, "prompt"),
    "prompt_empty_string": ({"prompt": ""}, "prompt"),
    "prompt_empty_list": ({"prompt": []}, "prompt"),
    "prompt_empty_token_list": ({"prompt": [[]]}, "prompt"),
    "prompt_second_token_list_empty": ({"prompt": [[1, 2], []]}, "prompt"),
    "prompt_number": ({"prompt": 5}, "prompt"),
    "prompt_object": ({"prompt": {"text": CANARY}}, "prompt"),
    "prompt_mixed_list": ({"prompt": [1, CANARY]}, "prompt"),
    "prompt_float_tokens": ({"prompt": [1.5, 2.0]}, "prompt"),
    "prompt_nested_strings": ({"prompt": [[CANARY]]}, "prompt"),
    "token_negative": ({"prompt": [5, -1, 7]}, "prompt"),
    "token_at_vocab": ({"prompt": [5, VOCAB]}, "prompt"),
    "token_huge": ({"prompt": [5, 2**40]}, "prompt"),
    "token_beyond_int64": ({"prompt": [5, 2**70]}, "prompt"),
    "token_list_of_lists_negative": ({"prompt": [[1, 2], [3, -4]]}, "prompt"),
    "logprobs_over_limit": ({"logprobs": 21}, "logprobs"),
    "logprobs_negative": ({"logprobs": -1}, "logprobs"),
    "logprobs_bool": ({"logprobs": True}, "logprobs"),
    "echo_string": ({"echo": "yes"}, "echo"),
    "max_tokens_zero": ({"max_tokens": 0}, "max_tokens"),
    "temperature_negative": ({"temperature": -1}, "temperature"),
    "top_p_zero": ({"top_p": 0.0}, "top_p"),
    "top_k_minus_five": ({"top_k": -5}, "top_k"),
    "n_absurd": ({"n": 100000}, "n"),
    "seed_over_int64": ({"seed": 2**64}, "seed"),
    "stream_options_without_stream": ({"stream_options": {"include_usage": True}}, "stream"),
    "stop_number": ({"stop": 1.5}, "stop"),
    "too_many_choices": ({"prompt": ["a"] * 2000, "n": 64}, "prompt"),
    "too_many_prompts": ({"prompt": ["a"] * 5000}, "prompt"),
}


@pytest.mark.parametrize("name", sorted(COMPLETION_CASES))
def test_completion_field_errors_are_400(http: httpx.Client, name: str) -> None:
    fields, field = COMPLETION_CASES[name]
    check_error(post_json(http, COMPLETIONS, completion_body(**fields)), 400, field)


@pytest.mark.parametrize("stream", [False, True])
def test_errors_before_streaming_are_plain_400(http: httpx.Client, stream: bool) -> None:
    """A prompt rejected by the tokenizer gives a 400 even when a stream was asked for."""
    body = completion_body(prompt=[1, VOCAB + 5], stream=stream)
    check_error(post_json(http, COMPLETIONS, body), 400, "prompt")
    body = chat_body(messages=[{"role": "user", "content": [{"type": "audio"}]}], stream=stream)
    check_error(post_json(http, CHAT, body), 400, "content")


# ---- 2. context length, exactly at and over the boundary -----------------------------------


def tokens(n: int) -> list[int]:
    return [100 + (i * 7) % 5000 for i in range(n)]


def test_context_boundary(http: httpx.Client) -> None:
    n = MAIN_MAX_SEQ_LEN
    ok = post_json(http, COMPLETIONS, completion_body(prompt=tokens(n - 1), max_tokens=1))
    assert ok.status_code == 200, ok.text[:500]
    usage = ok.json()["usage"]
    assert usage["prompt_tokens"] == n - 1 and usage["completion_tokens"] == 1
    assert ok.json()["choices"][0]["finish_reason"] == "length"
    fill = post_json(http, COMPLETIONS, completion_body(prompt=tokens(n - 1), max_tokens=DROP))
    assert fill.status_code == 200, fill.text[:500]
    assert fill.json()["usage"]["completion_tokens"] == 1

    over = post_json(http, COMPLETIONS, completion_body(prompt=tokens(n - 1), max_tokens=2))
    check_error(over, 400, code="context_length_exceeded")
    full = post_json(http, COMPLETIONS, completion_body(prompt=tokens(n), max_tokens=DROP))
    check_error(full, 400, code="context_length_exceeded")
    long = post_json(http, COMPLETIONS, completion_body(prompt=tokens(3 * n), max_tokens=1))
    check_error(long, 400, code="context_length_exceeded")
    text = " ".join(["word"] * (2 * n))
    chat = post_json(http, CHAT, chat_body(messages=[{"role": "user", "content": text}]))
    check_error(chat, 400, code="context_length_exceeded")
    huge_ask = post_json(http, CHAT, chat_body(max_tokens=10**6))
    check_error(huge_ask, 400, code="context_length_exceeded")


# ---- 3. model, size, key ----------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_unknown_model_is_404(http: httpx.Client, path: str) -> None:
    body = chat_body(model="gpt-4o") if path == CHAT else completion_body(model="gpt-4o")
    err = check_error(post_json(http, path, body), 404, code="model_not_found")
    assert err["param"] == "model"


def test_unknown_model_error_is_capped(http: httpx.Client) -> None:
    name = "m" * 20000 + CANARY
    check_error(post_json(http, CHAT, chat_body(model=name)), 404, code="model_not_found")


def test_oversized_body_is_413(http: httpx.Client) -> None:
    big = chat_body(messages=[{"role": "user", "content": "x" * (MAIN_MAX_BODY + 10)}])
    check_error(post_json(http, CHAT, big), 413)

    chunk = b"x" * 8192

    def chunked() -> Iterator[bytes]:
        yield b'{"model": "smollm2-135m", "prompt": "'
        for _ in range(MAIN_MAX_BODY // len(chunk) + 2):
            yield chunk
        yield b'"}'

    resp = http.post(COMPLETIONS, content=chunked(), headers={"Content-Type": "application/json"})
    check_error(resp, 413)
    under = chat_body(messages=[{"role": "user", "content": "x" * (MAIN_MAX_BODY - 200)}])
    assert post_json(http, CHAT, under).status_code != 413


@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong-key", "Basic cmVsaWFiaWxpdHkta2V5", "Bearer", "reliability-key"]
)
def test_missing_or_wrong_key_is_401(main_server: Server, auth: str | None) -> None:
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = auth
    with http_client(base_url=main_server.url) as raw:
        for path, body in ((CHAT, chat_body()), (COMPLETIONS, b"{not json")):
            content = body if isinstance(body, bytes) else json.dumps(body)
            err = check_error(raw.post(path, content=content, headers=headers), 401)
            assert err["type"] == "authentication_error"
        assert raw.get("/v1/models", headers=headers).status_code == 401
        assert raw.get("/health").status_code == 200
        assert raw.get("/metrics").status_code == 200


# ---- afterwards: nothing refused may leave a trace -----------------------------------------


def test_server_healthy_and_idle_after_bad_input(main_server: Server, http: httpx.Client) -> None:
    resp = post_json(http, CHAT, chat_body(messages=[{"role": "user", "content": "Hi"}]))
    assert resp.status_code == 200, resp.text[:500]
    assert resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
    wait_idle(main_server, timeout=15)
    assert read_metrics(http, main_server)["minisgl_num_inflight_requests"] == 0
