"""Continuous batching: a thin loop over the prefill, decode, table and cache managers."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from minisgl.engine.batch import Batch, BatchOutput, SampleInfo
from minisgl.kvcache import make_prefix_cache
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.cache_manager import CacheManager, CacheStats
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.decode import DecodeManager
from minisgl.scheduler.prefill import Chunk, PrefillManager
from minisgl.scheduler.request import Request
from minisgl.scheduler.table import TableManager

logger = logging.getLogger(__name__)


class EngineLike(Protocol):
    num_pages: int
    page_size: int
    max_seq_len: int
    eos_token_ids: frozenset[int]

    def forward(self, batch: Batch) -> BatchOutput: ...


@dataclass
class RequestOutput:
    """What happened to one request in one step."""

    rid: str
    new_token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finished: bool
    finish_reason: str | None
    error: str | None
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_queued: int
    kv: CacheStats
    retractions_total: int
    prefill_tokens_total: int


class Scheduler:
    """Turns a stream of requests into engine batches.

    Every step forms one forward: in mixed mode the running decodes plus prefill chunks
    within ``max_prefill_length``; otherwise a prefill batch and a decode batch alternate
    whenever both have work, so long prompts never starve running requests.
    """

    def __init__(self, engine: EngineLike, config: SchedulerConfig) -> None:
        self.engine = engine
        self.config = config
        self.page_size = engine.page_size
        self.max_seq_len = engine.max_seq_len
        self.total_tokens = engine.num_pages * engine.page_size
        self.cache = CacheManager(
            num_pages=engine.num_pages,
            page_size=engine.page_size,
            num_rows=config.max_running_requests,
            max_seq_len=engine.max_seq_len,
            prefix_cache=make_prefix_cache(config.cache, engine.page_size),
        )
        self.table = TableManager(config.max_running_requests)
        self.prefill = PrefillManager(self.cache, self.table, share=config.cache == "radix")
        self.decode = DecodeManager(self.cache)
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._arrival = itertools.count()
        self._last_was_prefill = False
        self.retractions_total = 0
        self.prefill_tokens_total = 0

    # ---- requests in -------------------------------------------------------------------
    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; an invalid one finishes at once with reason "error"."""
        req = Request(
            rid=rid, input_ids=list(input_ids), params=params, arrival=next(self._arrival)
        )
        error = self._reject_reason(req)
        if rid in self.requests:
            error = f"duplicate request id {rid!r}"
        if error is not None:
            self._pending.append(self._output(req, [], "error", error))
            return
        self.requests[rid] = req
        self.prefill.enqueue(req)

    def _reject_reason(self, req: Request) -> str | None:
        n = req.prompt_len
        if n == 0:
            return "the prompt is empty"
        if n + 1 > self.max_seq_len:
            return f"prompt of {n} tokens does not fit the context of {self.max_seq_len} tokens"
        pages = -(-(n + 1) // self.page_size)
        if pages * self.page_size > self.total_tokens:
            return f"prompt of {n} tokens can never fit the KV pool of {self.total_tokens} tokens"
        limit = self.config.max_queued_requests
        if limit is not None and len(self.prefill) >= limit:
            return "too many queued requests"
        return None

    def abort(self, rid: str) -> None:
        """End a request at any stage; frees all it holds. An "abort" output follows."""
        self._end(rid, "abort")

    def stop(self, rid: str) -> None:
        """End a request because a stop string matched (reason "stop")."""
        self._end(rid, "stop")

    def _end(self, rid: str, reason: str) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        if req in self.decode.running:
            self.decode.remove(req)
        elif req in self.prefill.waiting:
            self.prefill.remove(req)
        self._finish(req, reason)
        self._pending.append(self._output(req, [], reason, None))

    # ---- the loop ----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.prefill.waiting or self.decode.running or self._pending)

    def step(self) -> list[RequestOutput]:
        """Run at most one forward; return what happened to each request."""
        outputs, self._pending = self._pending, []
        chunks = self._schedule(outputs)
        if chunks:
            outputs.extend(self._run(chunks))
        if self.config.debug_invariant and not self.prefill.waiting and not self.decode.running:
            self.check_idle()
        return outputs

    def _schedule(self, outputs: list[RequestOutput]) -> list[Chunk]:
        budget = self.config.max_prefill_length
        if (
            not self.config.mixed
            and self.prefill.waiting
            and not (self._last_was_prefill and self.decode.running)
        ):
            chunks = self._schedule_prefill(budget)
            self._last_was_prefill = bool(chunks)
            if chunks:
                return chunks
        self._last_was_prefill = False
        retractions_before = self.retractions_total
        chunks = self._schedule_decode(outputs)
        if (self.config.mixed or not chunks) and self.retractions_total == retractions_before:
            chunks += self._schedule_prefill(budget - len(chunks))
        if not chunks and self.prefill.waiting and not self.decode.running:
            self._give_up_on_head(outputs)
        return chunks

    def _schedule_decode(self, outputs: list[RequestOutput]) -> list[Chunk]:
        if not self.decode.running:
            return []
        slots, stuck = self.decode.reserve(self._retract)
        for req in stuck:
            self._finish(req, "length")
            outputs.append(self._output(req, [], "length", None))
        chunks = []
        for req, loc in slots:
            start = req.device_len
            req.advance(1)
            chunks.append(Chunk(req, start, req.device_len, loc))
        return chunks

    def _schedule_prefill(self, budget: int) -> list[Chunk]:
        if budget <= 0 or not self.prefill.waiting:
            return []
        chunks = self.prefill.schedule(budget)
        for c in chunks:
            if c.samples:
                self.decode.add(c.req)
        self.prefill_tokens_total += sum(c.end - c.start for c in chunks)
        return chunks

    def _give_up_on_head(self, outputs: list[RequestOutput]) -> None:
        """Nothing runs and the first waiting request still cannot be placed: the whole pool
        cannot hold it (a retracted request that grew too long). End it rather than spin."""
        req = self.prefill.waiting.popleft()
        reason = "length" if req.output_ids else "error"
        error = None if req.output_ids else "the request cannot fit the KV pool"
        self._finish(req, reason)
        outputs.append(self._output(req, [], reason, error))

    def _retract(self, req: Request) -> None:
        self.cache.release(req.row, req.tokens(0, req.device_len))
        self.table.free(req.row)
        req.reset_device()
        self.prefill.requeue(req)
        self.retractions_total += 1
        logger.info("retracted %s (%d tokens) under KV pressure", req.rid, req.seq_len)

    def _run(self, chunks: list[Chunk]) -> list[RequestOutput]:
        banned_cache: dict[int, frozenset[int]] = {}
        samples: list[SampleInfo | None] = []
        for c in chunks:
            samples.append(
                c.req.sample_info(self._banned(c.req, banned_cache)) if c.samples else None
            )
        batch = Batch(
            table_idx=[c.req.row for c in chunks],
            cached_len=[c.start for c in chunks],
            device_len=[c.end for c in chunks],
            input_ids=[t for c in chunks for t in c.req.tokens(c.start, c.end)],
            out_loc=torch.cat([c.out_loc for c in chunks]),
            page_table=self.cache.page_table,
            sample=samples,
        )
        result = self.engine.forward(batch)
        for c in chunks:
            if c.end - c.start > 1:
                self.cache.cache_prefix(c.req.row, c.req.tokens(0, c.end))
        outputs: list[RequestOutput] = []
        k = 0
        for c in chunks:
            if not c.samples:
                continue
            req = c.req
            token = result.next_token_ids[k]
            req.output_ids.append(token)
            want = req.params.logprobs is not None
            lp = result.logprobs[k] if want and result.logprobs is not None else None
            top = result.top_logprobs[k] if want and result.top_logprobs is not None else None
            if lp is not None:
                req.logprobs.append(lp)
            k += 1
            reason = self._finish_reason(req, token)
            if reason is not None:
                self.decode.remove(req)
                self._finish(req, reason)
            outputs.append(
                self._output(
                    req,
                    [token],
                    reason,
                    None,
                    logprobs=[lp] if lp is not None else None,
                    top=[top] if top is not None else None,
                )
            )
        return outputs

    def _banned(self, req: Request, cache: dict[int, frozenset[int]]) -> frozenset[int]:
        p = req.params
        if req.output_len >= p.min_tokens:
            return frozenset()
        key = id(p)
        if key not in cache:
            eos = frozenset() if p.ignore_eos else self.engine.eos_token_ids
            cache[key] = eos | frozenset(p.stop_token_ids)
        return cache[key]

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if req.output_len >= p.min_tokens:
            if token in p.stop_token_ids:
                return "stop"
            if not p.ignore_eos and token in self.engine.eos_token_ids:
                return "stop"
        if req.output_len >= p.max_tokens or req.seq_len >= self.max_seq_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        if req.admitted:
            self.cache.release(req.row, req.tokens(0, req.device_len))
            self.table.free(req.row)
            req.reset_device()
        self.requests.pop(req.rid, None)

    def _output(
        self,
        req: Request,
        tokens: list[int],
        reason: str | None,
        error: str | None,
        logprobs: list[float] | None = None,
        top: list[list[tuple[int, float]]] | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            rid=req.rid,
            new_token_ids=tokens,
            logprobs=logprobs,
            top_logprobs=top,
            finished=reason is not None,
            finish_reason=reason,
            error=error,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.prompt_cached_len,
        )

    # ---- observability -----------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.decode),
            num_queued=len(self.prefill),
            kv=self.cache.stats(),
            retractions_total=self.retractions_total,
            prefill_tokens_total=self.prefill_tokens_total,
        )

    def check_idle(self) -> None:
        """At idle nothing is private or protected, and the cache invariant holds exactly."""
        try:
            self.cache.check_invariant()
            s = self.cache.stats()
            assert s.private == 0 and s.protected == 0, f"leak at idle: {s}"
            assert self.table.num_free == self.table.num_rows, "page-table rows leaked"
        except AssertionError:
            logger.critical("KV cache invariant broken at idle", exc_info=True)
            raise

    def run_until_idle(self) -> list[RequestOutput]:
        """Step until nothing is left (used by tests and the offline API)."""
        out: list[RequestOutput] = []
        while self.has_work():
            out.extend(self.step())
        return out
