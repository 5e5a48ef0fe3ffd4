"""The scheduler process: receive requests, step the Scheduler, send token ids on.

::

    tokenizer ──UserMsg/AbortMsg──┐
    detokenizer ──StopMsg─────────┴─> inbox ─> Scheduler.step() ─DetokenizeMsg─> detokenizer
                                                            └──── StatsMsg ────> api

While the scheduler has work, the inbox is drained without waiting between steps; when idle,
the loop blocks on it (waking every ``IDLE_POLL_MS`` to check that the launcher lives).
With tensor parallelism, rank 0 owns the sockets and broadcasts each batch of received
messages to the other ranks, so every rank runs the same schedule.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from minisgl.message import (
    AbortMsg,
    DetokenizeMsg,
    DetokRequest,
    StatsMsg,
    StopMsg,
    TokenOutput,
    UserMsg,
    decode,
    encode,
)
from minisgl.server.args import ServerArgs
from minisgl.server.ipc import IpcPaths, bind_pull, connect_push, recv_all, zmq_context
from minisgl.server.process import ParentLink

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500
STATS_INTERVAL_S = 0.25


class SchedulerLoop:
    """Drives one ``Scheduler``; only the side effects go through the injected callables."""

    def __init__(self, scheduler: Any, send_detok: Any, send_api: Any) -> None:
        self.scheduler = scheduler
        self._send_detok = send_detok
        self._send_api = send_api
        self._new: list[DetokRequest] = []
        self._last_stats = 0.0
        self._dirty = True

    def handle(self, msg: Any) -> None:
        s = self.scheduler
        if isinstance(msg, UserMsg):
            p = msg.params
            self._new.append(
                DetokRequest(msg.rid, list(p.stop), msg.skip_special_tokens, p.logprobs is not None)
            )
            logger.debug("add %s: %d prompt tokens", msg.rid, len(msg.input_ids))
            s.add_request(msg.rid, msg.input_ids, p)
        elif isinstance(msg, AbortMsg):
            for rid in msg.rids:
                s.abort(rid)
        elif isinstance(msg, StopMsg):
            for rid in msg.rids:
                s.stop(rid)
        else:
            logger.error("scheduler got an unexpected %s", type(msg).__name__)
            return
        self._dirty = True

    def step(self) -> None:
        """One scheduler step (if there is work) and its outputs sent downstream."""
        outputs = self.scheduler.step() if self.scheduler.has_work() else []
        if outputs:
            self._dirty = True
        if outputs or self._new:
            converted = [
                TokenOutput(
                    rid=o.rid,
                    token_ids=list(o.new_token_ids),
                    logprobs=o.logprobs,
                    top_logprobs=o.top_logprobs,
                    finished=o.finished,
                    finish_reason=o.finish_reason,
                    error=o.error,
                    prompt_tokens=o.prompt_tokens,
                    cached_tokens=o.cached_tokens,
                )
                for o in outputs
            ]
            self._send_detok(DetokenizeMsg(self._new, converted))
            self._new = []

    def publish_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        idle = not self.scheduler.has_work()
        due = now - self._last_stats >= STATS_INTERVAL_S
        if not (force or (self._dirty and (idle or due))):
            return
        st = self.scheduler.stats()
        kv = st.kv
        self._send_api(
            StatsMsg(
                num_running=st.num_running,
                num_queued=st.num_queued,
                kv_total=kv.total,
                kv_free=kv.free,
                kv_evictable=kv.evictable,
                kv_protected=kv.protected,
                kv_private=kv.private,
                retractions_total=st.retractions_total,
            )
        )
        self._last_stats = now
        self._dirty = not idle


class _Broadcaster:
    """Rank 0 -> all ranks: the messages received this iteration, as msgpack bytes."""

    def __init__(self, size: int) -> None:
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        self.group = dist.new_group(list(range(size)), backend="gloo")

    def share(self, msgs: list[Any] | None, is_src: bool) -> list[Any] | None:
        """On rank 0 send ``msgs`` (None: shut down); elsewhere return what rank 0 sent."""
        torch = self.torch
        if is_src:
            data = encode(msgs)
            size = torch.tensor([len(data)], dtype=torch.int64)
            self.dist.broadcast(size, src=0, group=self.group)
            self.dist.broadcast(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group
            )
            return msgs
        size = torch.zeros(1, dtype=torch.int64)
        self.dist.broadcast(size, src=0, group=self.group)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        self.dist.broadcast(buf, src=0, group=self.group)
        return decode(buf.numpy().tobytes())


def build_scheduler(args: ServerArgs, rank: int, master_port: int = 0) -> Any:
    """The engine and scheduler for one rank, configured from the command line.

    ``--max-queued-requests`` is enforced by the API process (503 before tokenizing, counting
    everything in flight), not by the scheduler's queue cap, which would also refuse a burst
    of requests that arrive together and would all be admitted by the next step.
    """
    from minisgl.engine.config import EngineConfig
    from minisgl.engine.engine import Engine
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.scheduler import Scheduler

    engine_kwargs: dict[str, Any] = dict(
        model=args.model,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype,
        device=args.device,
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_memory_gb=args.kv_memory_gb,
        attn=args.attn,
        tp_rank=rank,
        tp_size=args.tp,
        max_seq_len=args.max_seq_len,
        dist_init_method=f"tcp://127.0.0.1:{master_port}" if args.tp > 1 else None,
    )
    if args.memory_ratio is not None:
        engine_kwargs["memory_ratio"] = args.memory_ratio
    engine = Engine(EngineConfig(**engine_kwargs))
    config = SchedulerConfig(
        cache=args.cache,
        max_running_requests=args.max_running_requests,
        max_prefill_length=args.max_prefill_length,
        max_queued_requests=None,
        mixed=args.mixed,
        debug_invariant=args.debug_invariant,
    )
    return Scheduler(engine, config)


def engine_facts(engine: Any) -> dict[str, Any]:
    """What the launcher passes on to the tokenizer, detokenizer and API."""
    vocab = getattr(engine.model_config, "vocab_size", None)
    return {
        "model_path": str(engine.model_path),
        "max_seq_len": int(engine.max_seq_len),
        "vocab_size": int(vocab) if vocab is not None else 1 << 31,
        "kv_tokens": int(engine.num_pages * engine.page_size),
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "weight_dtype": str(engine.weight_dtype).removeprefix("torch."),
        "kv_dtype": str(engine.kv_dtype).removeprefix("torch."),
    }


def run_scheduler(
    link: ParentLink, paths: IpcPaths, args: ServerArgs, rank: int, master_port: int
) -> None:
    """Main of scheduler rank ``rank``."""
    with zmq_context() as ctx:
        inbox = bind_pull(ctx, paths, "scheduler") if rank == 0 else None
        if rank == 0:
            from minisgl.models.loader import resolve_model_path

            model_path = str(resolve_model_path(args.model))
            link.progress(model_path=model_path)
            args = dataclasses.replace(args, model=model_path)
        scheduler = build_scheduler(args, rank, master_port)
        bcast = _Broadcaster(args.tp) if args.tp > 1 else None
        link.ready(**engine_facts(scheduler.engine))
        if rank == 0:
            to_detok = connect_push(ctx, paths, "detokenizer")
            to_api = connect_push(ctx, paths, "api")
            loop = SchedulerLoop(
                scheduler, lambda m: to_detok.send(encode(m)), lambda m: to_api.send(encode(m))
            )
        else:
            loop = SchedulerLoop(scheduler, lambda m: None, lambda m: None)
        logger.info("scheduler rank %d ready", rank)
        _serve(loop, link, inbox, bcast)


def _serve(loop: SchedulerLoop, link: ParentLink, inbox: Any, bcast: _Broadcaster | None) -> None:
    """Receive (rank 0) or take rank 0's broadcast, handle, step; until the launcher is gone."""
    scheduler = loop.scheduler
    while True:
        if inbox is not None:
            timeout = 0 if scheduler.has_work() else IDLE_POLL_MS
            msgs = [decode(f) for f in recv_all(inbox, timeout)] if link.parent_alive() else None
            if bcast is not None:
                bcast.share(msgs, is_src=True)
        else:
            msgs = bcast.share(None, is_src=False)
        if msgs is None:
            return
        for msg in msgs:
            loop.handle(msg)
        loop.step()
        loop.publish_stats(force=not msgs and not scheduler.has_work())
