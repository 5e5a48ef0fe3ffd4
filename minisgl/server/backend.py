"""The API process's side of the pipeline: submit prompts, route replies to their requests.

``Backend`` is what the HTTP app and the shell talk to. Every accepted/reply message for a
request id goes into the asyncio queue given at submission (one queue per HTTP request,
shared by its choices) as ``(rid, message)``; a request leaves the table when its finished
reply arrives, which is also when its metrics are recorded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from minisgl.message import (
    AbortMsg,
    AcceptedMsg,
    ErrorInfo,
    Reply,
    ReplyBatch,
    StatsMsg,
    TokenizeMsg,
    decode,
    encode,
)
from minisgl.server.errors import ApiError, overloaded, unavailable
from minisgl.server.ipc import IpcPaths, bind_pull, connect_push
from minisgl.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    group: str
    queue: asyncio.Queue
    arrival: float
    first_token: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class Backend:
    """Request table, health and metrics of the API process; transport left to subclasses."""

    def __init__(self, max_inflight: int | None = None) -> None:
        self.max_inflight = max_inflight
        self.metrics = ServerMetrics()
        self.error: str | None = None
        self.facts: dict[str, Any] | None = None
        self.stopping = False
        self._reqs: dict[str, _Tracked] = {}

    @property
    def healthy(self) -> bool:
        return self.error is None

    @property
    def ready(self) -> bool:
        return self.facts is not None

    def set_ready(self, facts: dict[str, Any]) -> None:
        """The workers are up; ``facts`` are what the scheduler reported (max_seq_len ...)."""
        self.facts = dict(facts)

    @property
    def num_inflight(self) -> int:
        return len(self._reqs)

    async def submit(self, msg: TokenizeMsg, group: str, queue: asyncio.Queue) -> None:
        """Send one prompt (``len(msg.rids)`` choices) on its way; replies land in ``queue``.

        Raises ``ApiError`` 503 when unhealthy or when too many requests are in flight.
        """
        if self.error is not None:
            raise unavailable(f"the server is unhealthy: {self.error}")
        if self.facts is None:
            raise unavailable("the server is starting; retry shortly", code="starting")
        if self.stopping:
            raise unavailable("the server is shutting down", code="shutting_down")
        if self.max_inflight is not None and len(self._reqs) + len(msg.rids) > self.max_inflight:
            raise overloaded()
        data = _encode_request(msg)
        now = time.monotonic()
        for rid in msg.rids:
            self._reqs[rid] = _Tracked(group, queue, now)
        self._send(msg, data)

    def abort(self, rids: Iterable[str]) -> None:
        """Ask the scheduler to end these requests; their "abort" replies follow."""
        live = [r for r in rids if r in self._reqs]
        if live and self.error is None:
            msg = AbortMsg(live)
            self._send(msg, encode(msg))

    def is_inflight(self, rid: str) -> bool:
        return rid in self._reqs

    def group_rids(self, group: str) -> list[str]:
        return [rid for rid, t in self._reqs.items() if t.group == group]

    def finish_all(self, reason: str, error: ErrorInfo | None = None) -> None:
        """End every request here and now (shutdown, or a dead worker)."""
        rids = list(self._reqs)
        if reason == "abort":
            self.abort(rids)
        for rid in rids:
            self.deliver(Reply(rid, finished=True, finish_reason=reason, error=error))

    def shut_down(self) -> None:
        """Refuse new requests (503) and end those in flight with "abort"."""
        self.stopping = True
        self.finish_all("abort")

    def fail(self, error: str) -> None:
        """Mark the server unhealthy and end every request with a 503."""
        if self.error is None:
            self.error = error
        self.finish_all("error", ErrorInfo(error, 503, "service_unavailable_error"))

    def deliver(self, msg: AcceptedMsg | Reply) -> None:
        t = self._reqs.get(msg.rid)
        if t is None:
            return
        now = time.monotonic()
        if isinstance(msg, AcceptedMsg):
            t.prompt_tokens = msg.prompt_tokens
        else:
            if msg.num_tokens and t.first_token is None:
                t.first_token = now
            t.completion_tokens += msg.num_tokens
            if msg.prompt_tokens:
                t.prompt_tokens = msg.prompt_tokens
            t.cached_tokens = max(t.cached_tokens, msg.cached_tokens)
            if msg.finished:
                del self._reqs[msg.rid]
                self.metrics.on_finish(
                    msg.finish_reason or "error",
                    t.prompt_tokens,
                    t.cached_tokens,
                    t.completion_tokens,
                    None if t.first_token is None else t.first_token - t.arrival,
                    None if t.first_token is None else now - t.first_token,
                )
        t.queue.put_nowait((msg.rid, msg))

    def on_message(self, msg: object) -> None:
        if isinstance(msg, ReplyBatch):
            for reply in msg.replies:
                self.deliver(reply)
        elif isinstance(msg, AcceptedMsg):
            self.deliver(msg)
        elif isinstance(msg, StatsMsg):
            self.metrics.stats = msg
        else:
            logger.error("api got an unexpected %s", type(msg).__name__)

    def _send(self, msg: object, data: bytes) -> None:
        """Transport hook: ``data`` is ``msg`` already serialized."""
        raise NotImplementedError


def _encode_request(msg: TokenizeMsg) -> bytes:
    """Serialize, turning values msgpack cannot carry (ints beyond 64 bits) into a 400."""
    try:
        return encode(msg)
    except (TypeError, OverflowError, ValueError) as exc:
        raise ApiError(400, "a request field holds a value out of range") from exc


class ZmqBackend(Backend):
    """The real transport: PUSH to the tokenizer, PULL from the workers."""

    def __init__(self, paths: IpcPaths, max_inflight: int | None = None) -> None:
        super().__init__(max_inflight)
        self._ctx = zmq.asyncio.Context()
        self._inbox = bind_pull(self._ctx, paths, "api")
        self._sync_ctx = zmq.Context()
        self._to_tokenizer = connect_push(self._sync_ctx, paths, "tokenizer")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._receive())

    async def _receive(self) -> None:
        while True:
            frame = await self._inbox.recv()
            try:
                self.on_message(decode(frame))
            except Exception:
                logger.exception("bad message from a worker")

    def _send(self, msg: object, data: bytes) -> None:
        self._to_tokenizer.send(data, zmq.NOBLOCK)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._inbox.close(0)
        self._to_tokenizer.close(0)
        self._ctx.term()
        self._sync_ctx.term()
