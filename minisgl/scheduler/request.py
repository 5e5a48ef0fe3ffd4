"""A request's progress through the scheduler, in the DESIGN.md vocabulary.

::

    token ids   [ prompt ............................ | outputs ........ ]
                0        cached_len        device_len              seq_len
                |<- from prefix cache ->|            |               |
                |<------ KV in the pool ----------->|<- to compute ->|

``cached_len <= device_len <= seq_len``. While prefilling, ``seq_len - device_len`` may be
large (chunked over several forwards); while decoding it is exactly 1 (the newest sampled
token has no KV yet). A retracted request drops back to ``device_len == cached_len == 0``
and keeps its outputs, which are recomputed as part of its next prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.engine.batch import SampleInfo
from minisgl.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    row: int = -1
    cached_len: int = 0
    device_len: int = 0
    prompt_cached_len: int = 0
    """Prompt tokens served from the prefix cache at first admission (reported to clients)."""
    admitted_once: bool = False
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def pending_len(self) -> int:
        """Tokens still to compute before the next sample."""
        return self.seq_len - self.device_len

    @property
    def admitted(self) -> bool:
        return self.row >= 0

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids of positions ``[start, end)`` across prompt and outputs."""
        p = self.prompt_len
        if end <= p:
            return self.input_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.input_ids[start:] + self.output_ids[: end - p]

    def advance(self, extend_len: int) -> None:
        assert 0 < extend_len <= self.pending_len, (extend_len, self.pending_len)
        self.device_len += extend_len

    def reset_device(self) -> None:
        self.row = -1
        self.cached_len = 0
        self.device_len = 0

    def sample_info(self, banned: frozenset[int]) -> SampleInfo:
        info = SampleInfo(params=self.params, prompt_ids=self.input_ids, output_ids=self.output_ids)
        if banned:
            info.banned_token_ids = banned
        return info
