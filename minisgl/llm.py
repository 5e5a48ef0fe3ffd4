"""Offline Python API: ``LLM(model).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from minisgl.sampling_params import SamplingParams

Prompt = str | list[int] | list[dict[str, Any]]


@dataclass
class GenerationResult:
    """One prompt's finished generation."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)


@dataclass
class StreamDelta:
    """Incremental progress of prompt ``index``: new text and token ids since the last one."""

    index: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None = None


class LLM:
    """An engine, a scheduler and a tokenizer in this process.

    ``model=None`` serves the built-in default (SmolLM2-135M-Instruct).
    """

    def __init__(
        self,
        model: str | None = None,
        cache: str = "radix",
        page_size: int = 1,
        num_pages: int | None = None,
        max_running_requests: int = 64,
        max_prefill_length: int = 2048,
        device: str = "auto",
        dtype: str = "auto",
        weight_dtype: str = "auto",
        kv_dtype: str = "auto",
        tp: int = 1,
        mixed: bool = True,
        debug_invariant: bool = False,
    ) -> None:
        if tp != 1:
            raise ValueError("the offline LLM runs tp=1; use `python -m minisgl --tp N` for TP")
        from minisgl.engine.config import EngineConfig
        from minisgl.engine.engine import Engine
        from minisgl.scheduler.config import SchedulerConfig
        from minisgl.scheduler.scheduler import Scheduler
        from minisgl.tokenizer import load_tokenizer

        self.engine = Engine(
            EngineConfig(
                model=model,
                dtype=dtype,
                weight_dtype=weight_dtype,
                kv_dtype=kv_dtype,
                device=device,
                page_size=page_size,
                num_pages=num_pages,
            )
        )
        self.tokenizer = load_tokenizer(self.engine.model_path)
        self.scheduler = Scheduler(
            self.engine,
            SchedulerConfig(
                cache=cache,
                max_running_requests=max_running_requests,
                max_prefill_length=max_prefill_length,
                mixed=mixed,
                debug_invariant=debug_invariant,
            ),
        )
        self._ids = itertools.count()

    def encode(self, prompt: Prompt) -> list[int]:
        from minisgl.tokenizer import encode_chat, encode_text

        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt)
        if prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)  # type: ignore[arg-type]
        return encode_chat(self.tokenizer, list(prompt))  # type: ignore[arg-type]

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (strings, chat message lists or token-id lists)."""
        results = [GenerationResult("", [], "", 0, 0) for _ in prompts]
        for delta in self._drive(prompts, sampling_params, results):
            results[delta.index].text += delta.text
        return results

    def stream(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamDelta]:
        """Yield text deltas as the batch progresses (stop strings are never streamed)."""
        results = [GenerationResult("", [], "", 0, 0) for _ in prompts]
        yield from self._drive(prompts, sampling_params, results)

    def _drive(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        results: list[GenerationResult],
    ) -> Iterator[StreamDelta]:
        from minisgl.tokenizer import IncrementalDetokenizer

        params = _broadcast_params(sampling_params, len(prompts))
        index: dict[str, int] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            rid = f"offline-{next(self._ids)}"
            index[rid] = i
            detoks[rid] = IncrementalDetokenizer(self.tokenizer, stop=p.stop)
            try:
                p.validate()
                ids = self.encode(prompt)
            except ValueError as e:
                results[i].error = str(e)
                ids = []
            self.scheduler.add_request(rid, ids, p)
        while self.scheduler.has_work():
            for out in self.scheduler.step():
                i = index[out.rid]
                res, detok = results[i], detoks[out.rid]
                res.prompt_tokens, res.cached_tokens = out.prompt_tokens, out.cached_tokens
                text = ""
                if out.new_token_ids and not detok.stopped:
                    res.token_ids.extend(out.new_token_ids)
                    res.logprobs.extend(out.logprobs or [])
                    text = detok.add(out.new_token_ids)
                    if detok.stopped:
                        self.scheduler.stop(out.rid)
                if out.finished:
                    if not detok.stopped:
                        text += detok.flush()
                    res.finish_reason = out.finish_reason or "stop"
                    res.error = res.error or out.error
                if text or out.finished:
                    yield StreamDelta(
                        i, text, list(out.new_token_ids), out.finished, out.finish_reason, out.error
                    )


def _broadcast_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if len(sampling_params) != n:
        raise ValueError(f"got {len(sampling_params)} sampling params for {n} prompts")
    return list(sampling_params)
