"""Messages between the API server and the tokenizer / detokenizer workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.message.codec import register
from minisgl.sampling_params import SamplingParams


@register
@dataclass
class TokenizeMsg:
    """API -> tokenizer: one prompt, generated ``len(rids)`` times (OpenAI's ``n``).

    Exactly one of ``text``, ``messages`` (chat) and ``input_ids`` is set. When
    ``fill_max_tokens`` is true the client gave no ``max_tokens`` and every choice may use
    the rest of the context.
    """

    rids: list[str]
    params: list[SamplingParams]
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    fill_max_tokens: bool = False
    echo: bool = False
    skip_special_tokens: bool = True


@register
@dataclass
class AbortMsg:
    """API -> tokenizer -> scheduler: end these requests (unknown ids are ignored)."""

    rids: list[str]


@register
@dataclass
class ErrorInfo:
    """An error in OpenAI's shape plus the HTTP status to answer with."""

    message: str
    status: int = 400
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None


@register
@dataclass
class AcceptedMsg:
    """Tokenizer -> API: the request passed tokenization and is on its way to the scheduler."""

    rid: str
    prompt_tokens: int
    prompt_text: str | None = None
    """The prompt as text, only when ``echo`` was asked for."""


@register
@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@register
@dataclass
class Reply:
    """Detokenizer (or tokenizer, for errors) -> API: what one request produced lately."""

    rid: str
    text: str = ""
    num_tokens: int = 0
    """Output tokens covered by this reply (after stop-string truncation)."""
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: ErrorInfo | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@register
@dataclass
class ReplyBatch:
    replies: list[Reply]
