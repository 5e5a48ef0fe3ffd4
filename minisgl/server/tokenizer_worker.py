"""The tokenizer process: prompts in, token ids out to the scheduler.

It owns the context-length check (it is the first place that knows the prompt's length), so
a too-long request is answered with ``context_length_exceeded`` before any scheduling.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from minisgl.message import (
    AbortMsg,
    AcceptedMsg,
    ErrorInfo,
    Reply,
    ReplyBatch,
    TokenizeMsg,
    UserMsg,
    decode,
    encode,
)
from minisgl.server.ipc import IpcPaths, bind_pull, connect_push, recv_all, zmq_context
from minisgl.server.process import ParentLink

logger = logging.getLogger(__name__)


class PromptError(ValueError):
    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


class Tokenizer:
    """Turns a :class:`TokenizeMsg` into per-choice :class:`UserMsg` s, or an error."""

    def __init__(self, tok: Any, max_seq_len: int, vocab_size: int) -> None:
        from minisgl.tokenizer import encode_chat, encode_text

        self.tok = tok
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self._encode_chat = encode_chat
        self._encode_text = encode_text

    def encode(self, msg: TokenizeMsg) -> tuple[list[int], str]:
        """The prompt's token ids and the field it came from."""
        if msg.messages is not None:
            where = "messages"
            try:
                return self._encode_chat(self.tok, msg.messages), where
            except Exception as exc:
                raise PromptError(ErrorInfo(str(exc), param=where)) from exc
        if msg.text is not None:
            try:
                ids = self._encode_text(self.tok, msg.text)
            except Exception as exc:
                raise PromptError(ErrorInfo(str(exc), param="prompt")) from exc
            return ids, "prompt"
        ids = list(msg.input_ids or [])
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(
                ErrorInfo(
                    f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                    param="prompt",
                )
            )
        return ids, "prompt"

    def prepare(self, msg: TokenizeMsg) -> tuple[list[UserMsg], str | None]:
        """Build the scheduler requests; raise :class:`PromptError` when they cannot run."""
        ids, where = self.encode(msg)
        n = len(ids)
        if n == 0:
            raise PromptError(ErrorInfo(f"the {where} produced no tokens", param=where))
        users = []
        for rid, params in zip(msg.rids, msg.params, strict=True):
            if msg.fill_max_tokens:
                params.max_tokens = max(self.max_seq_len - n, 0)
                params.min_tokens = min(params.min_tokens, params.max_tokens)
            if params.max_tokens < 1 or n + params.max_tokens > self.max_seq_len:
                asked = max(params.max_tokens, 1)
                raise PromptError(
                    ErrorInfo(
                        f"This model's maximum context length is {self.max_seq_len} tokens. "
                        f"However, you requested {n + asked} tokens ({n} in the {where}, "
                        f"{asked} in the completion). Please reduce the length of the "
                        f"{where} or completion.",
                        code="context_length_exceeded",
                        param=where,
                    )
                )
            users.append(UserMsg(rid, ids, params, msg.skip_special_tokens))
        return users, (self._prompt_text(msg, ids) if msg.echo else None)

    def _prompt_text(self, msg: TokenizeMsg, ids: list[int]) -> str:
        if msg.text is not None:
            return msg.text
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def run_tokenizer(link: ParentLink, paths: IpcPaths) -> None:
    """Main loop of the tokenizer process."""
    with zmq_context() as ctx:
        inbox = bind_pull(ctx, paths, "tokenizer")
        to_scheduler = connect_push(ctx, paths, "scheduler")
        to_api = connect_push(ctx, paths, "api")
        from minisgl.tokenizer import load_tokenizer

        config = link.wait_config()
        tok = load_tokenizer(config.model_path)
        while config.max_seq_len is None or config.vocab_size is None:
            config = link.wait_config()
        worker = Tokenizer(tok, config.max_seq_len, config.vocab_size)
        link.ready()
        while link.parent_alive():
            for frame in recv_all(inbox, timeout_ms=500):
                msg = decode(frame)
                if isinstance(msg, AbortMsg):
                    to_scheduler.send(frame)
                elif isinstance(msg, TokenizeMsg):
                    _handle(worker, msg, to_scheduler, to_api)
                else:
                    logger.error("tokenizer got an unexpected %s", type(msg).__name__)


def _handle(worker: Tokenizer, msg: TokenizeMsg, to_scheduler: zmq.Socket, to_api: zmq.Socket):
    try:
        users, prompt_text = worker.prepare(msg)
    except PromptError as exc:
        replies = [
            Reply(rid, finished=True, finish_reason="error", error=exc.info) for rid in msg.rids
        ]
        to_api.send(encode(ReplyBatch(replies)))
        return
    except Exception as exc:
        logger.exception("tokenizing failed")
        info = ErrorInfo(f"tokenization failed: {exc}", status=500, type="internal_error")
        replies = [Reply(rid, finished=True, finish_reason="error", error=info) for rid in msg.rids]
        to_api.send(encode(ReplyBatch(replies)))
        return
    for user in users:
        to_api.send(encode(AcceptedMsg(user.rid, len(user.input_ids), prompt_text)))
    for user in users:
        to_scheduler.send(encode(user))
