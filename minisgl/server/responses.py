"""OpenAI response bodies and server-sent-event streams built from a :class:`Generation`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from minisgl.message import AcceptedMsg, Reply, TokenLogprob
from minisgl.server.errors import ApiError
from minisgl.server.generation import Choice, Generation


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(t.token, t.logprob), "top_logprobs": [entry(a, lp) for a, lp in t.top]}
            for t in items
        ]
    }


def completion_logprobs(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in items],
        "token_logprobs": [t.logprob for t in items],
        "top_logprobs": [dict(t.top) for t in items],
        "text_offset": offsets,
    }


def chat_response(gen: Generation, model: str, want_logprobs: bool) -> dict[str, Any]:
    return {
        "id": gen.id,
        "object": "chat.completion",
        "created": gen.created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": chat_logprobs(c.logprobs) if want_logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in gen.choices
        ],
        "usage": gen.usage(),
    }


def completion_response(gen: Generation, model: str, want_logprobs: bool) -> dict[str, Any]:
    choices = []
    for c in gen.choices:
        prefix = c.prompt_text or ""
        choices.append(
            {
                "index": c.index,
                "text": prefix + "".join(c.text),
                "logprobs": completion_logprobs(c.logprobs, len(prefix)) if want_logprobs else None,
                "finish_reason": c.finish_reason,
            }
        )
    return {
        "id": gen.id,
        "object": "text_completion",
        "created": gen.created,
        "model": model,
        "choices": choices,
        "usage": gen.usage(),
    }


# ---- streaming ---------------------------------------------------------------------------


def sse(data: dict[str, Any] | str) -> bytes:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {body}\n\n".encode()


async def stream_chat(
    gen: Generation, model: str, want_logprobs: bool, include_usage: bool
) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {
            "id": gen.id,
            "object": "chat.completion.chunk",
            "created": gen.created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            out["usage"] = None
        return out

    def choice(c: Choice, delta: dict[str, Any], reply: Reply | None = None, finish=None):
        lp = chat_logprobs(reply.logprobs) if want_logprobs and reply and reply.logprobs else None
        return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    try:
        for c in gen.choices:
            yield sse(chunk([choice(c, {"role": "assistant", "content": ""})]))
        async for c, msg in gen.events():
            if not isinstance(msg, Reply):
                continue
            if msg.error is not None:
                yield sse(ApiError.from_info(msg.error).body())
                continue
            if msg.text or (want_logprobs and msg.logprobs):
                yield sse(chunk([choice(c, {"content": msg.text}, msg)]))
            if msg.finished:
                yield sse(chunk([choice(c, {}, finish=c.finish_reason)]))
        if include_usage:
            yield sse({**chunk([]), "usage": gen.usage()})
        yield sse("[DONE]")
    finally:
        gen.abort()


async def stream_completion(
    gen: Generation, model: str, want_logprobs: bool, include_usage: bool
) -> AsyncIterator[bytes]:
    offsets = {c.index: 0 for c in gen.choices}

    def chunk(c: Choice, text: str, reply: Reply | None = None, finish=None) -> dict[str, Any]:
        lp = None
        if want_logprobs and reply is not None and reply.logprobs:
            lp = completion_logprobs(reply.logprobs, offsets[c.index])
            offsets[c.index] += sum(len(t.token) for t in reply.logprobs)
        out = {
            "id": gen.id,
            "object": "text_completion",
            "created": gen.created,
            "model": model,
            "choices": [{"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}],
        }
        if include_usage:
            out["usage"] = None
        return out

    try:
        async for c, msg in gen.events():
            if isinstance(msg, AcceptedMsg):
                if msg.prompt_text:
                    offsets[c.index] = len(msg.prompt_text)
                    yield sse(chunk(c, msg.prompt_text))
                continue
            if msg.error is not None:
                yield sse(ApiError.from_info(msg.error).body())
                continue
            if msg.text or (want_logprobs and msg.logprobs):
                yield sse(chunk(c, msg.text, msg))
            if msg.finished:
                yield sse(chunk(c, "", finish=c.finish_reason))
        if include_usage:
            usage = {
                "id": gen.id,
                "object": "text_completion",
                "created": gen.created,
                "model": model,
                "choices": [],
                "usage": gen.usage(),
            }
            yield sse(usage)
        yield sse("[DONE]")
    finally:
        gen.abort()
