"""Messages into and out of the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.message.codec import register
from minisgl.sampling_params import SamplingParams

register(SamplingParams)


@register
@dataclass
class UserMsg:
    """Tokenizer -> scheduler: a tokenized request, ready to schedule."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    skip_special_tokens: bool = True


@register
@dataclass
class StopMsg:
    """Detokenizer -> scheduler: a stop string matched; end these with reason "stop"."""

    rids: list[str]


@register
@dataclass
class DetokRequest:
    """How the detokenizer should render one new request's output."""

    rid: str
    stop: list[str]
    skip_special_tokens: bool = True
    logprobs: bool = False


@register
@dataclass
class TokenOutput:
    """What one request produced in one scheduler step."""

    rid: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@register
@dataclass
class DetokenizeMsg:
    """Scheduler -> detokenizer, once per step: new requests first, then every output."""

    new: list[DetokRequest]
    outputs: list[TokenOutput]


@register
@dataclass
class StatsMsg:
    """Scheduler -> API: a snapshot for /metrics (KV sizes in tokens)."""

    num_running: int
    num_queued: int
    kv_total: int
    kv_free: int
    kv_evictable: int
    kv_protected: int
    kv_private: int
    retractions_total: int
