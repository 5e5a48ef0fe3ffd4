"""The detokenizer process: token ids in, text deltas out, stop strings matched.

Per request it keeps an ``IncrementalDetokenizer``. When a stop string matches, the request
is finished here with reason "stop" and the scheduler is told to end it; whatever the
scheduler still sends for it is dropped until its final output arrives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from minisgl.message import (
    DetokenizeMsg,
    DetokRequest,
    ErrorInfo,
    Reply,
    ReplyBatch,
    StopMsg,
    TokenLogprob,
    TokenOutput,
    decode,
    encode,
)
from minisgl.server.ipc import IpcPaths, bind_pull, connect_push, recv_all, zmq_context
from minisgl.server.process import ParentLink

logger = logging.getLogger(__name__)


def scheduler_error(message: str) -> ErrorInfo:
    """An error the scheduler reported for one request, as the client should see it."""
    if "too many queued" in message:
        return ErrorInfo(
            message, status=503, type="service_unavailable_error", code="server_overloaded"
        )
    return ErrorInfo(message, status=400)


@dataclass
class _State:
    detok: Any
    logprobs: bool
    done: bool = False
    token_count: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)


class Detokenizer:
    """Pure logic of the detokenizer process (no sockets), one call per scheduler step."""

    def __init__(self, tok: Any) -> None:
        from minisgl.tokenizer import IncrementalDetokenizer

        self.tok = tok
        self._make = IncrementalDetokenizer
        self.states: dict[str, _State] = {}
        self._token_text: dict[int, str] = {}

    def add_request(self, req: DetokRequest) -> None:
        detok = self._make(self.tok, stop=req.stop, skip_special_tokens=req.skip_special_tokens)
        self.states[req.rid] = _State(detok, req.logprobs)

    def process(self, msg: DetokenizeMsg) -> tuple[list[Reply], list[str]]:
        """Replies for the API and the ids the scheduler must stop."""
        for req in msg.new:
            self.add_request(req)
        replies: list[Reply] = []
        stops: list[str] = []
        for out in msg.outputs:
            reply = self._output(out, stops)
            if reply is not None:
                replies.append(reply)
        return replies, stops

    def _output(self, out: TokenOutput, stops: list[str]) -> Reply | None:
        st = self.states.get(out.rid)
        if st is None:
            logger.warning("output for unknown request %s", out.rid)
            return None
        if st.done:
            if out.finished:
                del self.states[out.rid]
            return None
        reply = Reply(out.rid, prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens)
        text = st.detok.add(out.token_ids) if out.token_ids else ""
        reply.num_tokens = len(out.token_ids)
        st.token_count += len(out.token_ids)
        if st.logprobs and out.logprobs is not None:
            reply.logprobs = self._logprobs(out)
        if st.detok.stopped:
            reply.finished, reply.finish_reason = True, "stop"
            if out.finished:
                del self.states[out.rid]
            else:
                st.done = True
                stops.append(out.rid)
        elif out.finished:
            text += st.detok.flush()
            reply.finished, reply.finish_reason = True, out.finish_reason
            if out.finish_reason == "error":
                reply.error = scheduler_error(out.error or "the request failed")
            del self.states[out.rid]
        reply.text = text
        return reply

    def _logprobs(self, out: TokenOutput) -> list[TokenLogprob]:
        tops = out.top_logprobs or [[] for _ in out.token_ids]
        return [
            TokenLogprob(
                token_id=t,
                token=self.token_text(t),
                logprob=lp,
                top=[(self.token_text(a), alp) for a, alp in top],
            )
            for t, lp, top in zip(out.token_ids, out.logprobs or [], tops, strict=False)
        ]

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tok.decode([token_id], clean_up_tokenization_spaces=False)
            self._token_text[token_id] = text
        return text


def run_detokenizer(link: ParentLink, paths: IpcPaths) -> None:
    """Main loop of the detokenizer process."""
    with zmq_context() as ctx:
        inbox = bind_pull(ctx, paths, "detokenizer")
        to_api = connect_push(ctx, paths, "api")
        to_scheduler = connect_push(ctx, paths, "scheduler")
        from minisgl.tokenizer import load_tokenizer

        config = link.wait_config()
        worker = Detokenizer(load_tokenizer(config.model_path))
        link.ready()
        while link.parent_alive():
            replies: list[Reply] = []
            stops: list[str] = []
            for frame in recv_all(inbox, timeout_ms=500):
                msg = decode(frame)
                if not isinstance(msg, DetokenizeMsg):
                    logger.error("detokenizer got an unexpected %s", type(msg).__name__)
                    continue
                r, s = worker.process(msg)
                replies.extend(r)
                stops.extend(s)
            if stops:
                to_scheduler.send(encode(StopMsg(stops)))
            if replies:
                to_api.send(encode(ReplyBatch(replies)))
