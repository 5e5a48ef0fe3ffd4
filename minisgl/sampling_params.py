"""Per-request sampling and stopping parameters, shared by the offline API and the server."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy. ``logprobs=None`` returns no log-probabilities,
    ``logprobs=0`` the chosen token's only, ``logprobs=k`` also the top-k alternatives.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 256
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"'{name}' {why}")

        def finite(name: str, value: float) -> None:
            if not isinstance(value, int | float) or isinstance(value, bool):
                bad(name, "must be a number")
            if not math.isfinite(value):
                bad(name, "must be a finite number")

        finite("temperature", self.temperature)
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "must be between 0 and 100")
        finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            bad("top_k", "must be -1 (disabled) or a positive integer")
        finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        finite("presence_penalty", self.presence_penalty)
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        finite("frequency_penalty", self.frequency_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        finite("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", "must be in (0, 2]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be a positive integer")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be between 0 and max_tokens")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not INT64_MIN <= self.seed <= INT64_MAX
        ):
            bad("seed", "must be an integer within int64")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            bad("logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
