"""The plain batch description the scheduler hands to the engine, and what comes back.

The scheduler deals only in ids and slot indices; the engine turns a ``Batch`` into tensors.
For request ``i`` the forward computes positions ``[cached_len[i], device_len[i])``::

    position   0 ........ cached_len[i] ............ device_len[i]
               |  KV already in pool  |  computed now (extend)  |
    input_ids                         ^^^^^^^^^^^^^^^^^^^^^^^^^^^  (concatenated over i)
    out_loc                           slots where the new K/V go   (same order)

Slots of all positions ``[0, device_len[i])`` are read from ``page_table[table_idx[i]]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minisgl.sampling_params import SamplingParams


@dataclass
class SampleInfo:
    """What the sampler needs for one request that samples a token in this batch."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    """Tokens generated so far; ``len(output_ids)`` is the step index used for seeding."""
    banned_token_ids: frozenset[int] = frozenset()
    """Tokens that must not be sampled now (EOS before ``min_tokens``); masked to -inf."""


@dataclass
class Batch:
    table_idx: list[int]
    cached_len: list[int]
    device_len: list[int]
    input_ids: list[int]
    out_loc: torch.Tensor
    """int64 slot indices, one per entry of ``input_ids``."""
    page_table: torch.Tensor
    """Host int32 tensor ``[rows, max_seq_len]``: ``page_table[row, pos]`` is a token slot."""
    sample: list[SampleInfo | None] = field(default_factory=list)
    """Per request: sampling info, or None when this forward only fills KV (a non-final chunk)."""

    @property
    def size(self) -> int:
        return len(self.table_idx)

    @property
    def extend_lens(self) -> list[int]:
        return [d - c for c, d in zip(self.cached_len, self.device_len, strict=True)]

    @property
    def is_decode(self) -> bool:
        return all(d - c == 1 for c, d in zip(self.cached_len, self.device_len, strict=True))


@dataclass
class BatchOutput:
    """One entry per request with ``sample[i] is not None``, in batch order."""

    next_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
