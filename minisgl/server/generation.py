"""From validated OpenAI requests to backend submissions, and replies back to choices.

A :class:`Generation` is one HTTP request in flight: ``len(prompts) * n`` choices, each a
scheduler request with id ``{response id}-{choice index}``. Choice ``i`` belongs to prompt
``i // n`` (OpenAI's ordering for completions with several prompts).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from minisgl.message import AcceptedMsg, ErrorInfo, Reply, TokenizeMsg, TokenLogprob
from minisgl.server.backend import Backend
from minisgl.server.errors import ApiError
from minisgl.server.protocol import ChatCompletionRequest, CompletionRequest


@dataclass
class Choice:
    index: int
    prompt_index: int
    rid: str
    accepted: bool = False
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: ErrorInfo | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, msg: AcceptedMsg | Reply) -> None:
        self.accepted = True
        if isinstance(msg, AcceptedMsg):
            self.prompt_tokens = msg.prompt_tokens
            self.prompt_text = msg.prompt_text
            return
        if msg.text:
            self.text.append(msg.text)
        if msg.logprobs:
            self.logprobs.extend(msg.logprobs)
        self.completion_tokens += msg.num_tokens
        if msg.prompt_tokens:
            self.prompt_tokens = msg.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, msg.cached_tokens)
        if msg.finished:
            self.finish_reason = msg.finish_reason or "error"
            self.error = msg.error


class Generation:
    """The choices of one HTTP request and the queue their replies arrive on."""

    def __init__(self, backend: Backend, id_prefix: str, num_prompts: int, n: int) -> None:
        self.backend = backend
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = n
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices = [
            Choice(index=i, prompt_index=i // n, rid=f"{self.id}-{i}")
            for i in range(num_prompts * n)
        ]
        self._by_rid = {c.rid: c for c in self.choices}
        self._backlog: list[tuple[Choice, AcceptedMsg | Reply]] = []

    async def submit(self, msgs: list[TokenizeMsg]) -> None:
        try:
            for msg in msgs:
                await self.backend.submit(msg, self.id, self.queue)
        except BaseException:
            self.abort()
            raise

    def rids_of(self, prompt_index: int) -> list[str]:
        return [c.rid for c in self.choices if c.prompt_index == prompt_index]

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    async def _next(self) -> tuple[Choice, AcceptedMsg | Reply]:
        rid, msg = await self.queue.get()
        choice = self._by_rid[rid]
        choice.apply(msg)
        return choice, msg

    async def wait_started(self) -> None:
        """Wait until every choice is accepted; an error anywhere becomes an ``ApiError``."""
        try:
            while not all(c.accepted for c in self.choices):
                choice, msg = await self._next()
                self._backlog.append((choice, msg))
                self._raise_if_failed(choice)
        except asyncio.CancelledError:
            self.abort()
            raise

    def _raise_if_failed(self, choice: Choice) -> None:
        if choice.error is not None:
            self.abort()
            raise ApiError.from_info(choice.error)

    async def events(self) -> AsyncIterator[tuple[Choice, AcceptedMsg | Reply]]:
        """Every message in arrival order (those seen by ``wait_started`` first)."""
        backlog, self._backlog = self._backlog, []
        for item in backlog:
            yield item
        while not self.done:
            yield await self._next()

    async def run_to_end(self, disconnected: Callable[[], Awaitable[Any]] | None = None) -> bool:
        """Consume everything; False (after aborting) if ``disconnected`` completes first."""
        watcher = asyncio.ensure_future(disconnected()) if disconnected else None
        try:
            while not self.done:
                getter = asyncio.ensure_future(self._next())
                waiting = {getter} | ({watcher} if watcher else set())
                finished, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if getter not in finished:
                    getter.cancel()
                    self.abort()
                    return False
                choice, _ = getter.result()
                self._raise_if_failed(choice)
            return True
        finally:
            if watcher is not None:
                watcher.cancel()

    def abort(self) -> None:
        self.backend.abort([c.rid for c in self.choices if not c.finished])

    def usage(self) -> dict[str, Any]:
        prompt = cached = 0
        for p in sorted({c.prompt_index for c in self.choices}):
            group = [c for c in self.choices if c.prompt_index == p]
            prompt += max(c.prompt_tokens for c in group)
            cached += max(c.cached_tokens for c in group)
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


async def start_chat(backend: Backend, req: ChatCompletionRequest) -> Generation:
    params = req.sampling_params()
    gen = Generation(backend, "chatcmpl", 1, req.num_choices)
    msg = TokenizeMsg(
        rids=gen.rids_of(0),
        params=req.choice_params(params),
        messages=req.template_messages(),
        fill_max_tokens=req.requested_max_tokens is None,
        skip_special_tokens=req.skip_special_tokens is not False,
    )
    await gen.submit([msg])
    return gen


async def start_completion(backend: Backend, req: CompletionRequest) -> Generation:
    params = req.sampling_params()
    prompts = req.prompts()
    gen = Generation(backend, "cmpl", len(prompts), req.num_choices)
    skip = req.skip_special_tokens is not False
    items = [
        {"text": p, "skip_special_tokens": skip}
        if isinstance(p, str)
        else {"input_ids": p, "skip_special_tokens": skip}
        for p in prompts
    ]
    msgs = [
        TokenizeMsg(
            rids=gen.rids_of(i),
            params=req.choice_params(params),
            fill_max_tokens=req.max_tokens is None,
            echo=bool(req.echo),
            **item,
        )
        for i, item in enumerate(items)
    ]
    await gen.submit(msgs)
    return gen
