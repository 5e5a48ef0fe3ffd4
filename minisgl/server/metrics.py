"""Prometheus text exposition of the server's counters, gauges and histograms."""

from __future__ import annotations

import bisect
import math
from collections import Counter

from minisgl.message import StatsMsg

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: ``le`` upper bounds)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = []
        running = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            running += n
            le = "+Inf" if bound == math.inf else repr(float(bound))
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out.append(f"{name}_sum {self.sum!r}")
        out.append(f"{name}_count {self.count}")
        return out


class ServerMetrics:
    """What the API process counts itself, plus the scheduler's latest snapshot."""

    def __init__(self) -> None:
        self.requests_total: Counter[str] = Counter()
        self.prompt_tokens_total = 0
        self.cached_prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.stats: StatsMsg | None = None

    def on_finish(
        self,
        finish_reason: str,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        ttft: float | None,
        decode_seconds: float | None,
    ) -> None:
        """Record one finished request (one choice); times in seconds."""
        self.requests_total[finish_reason] += 1
        self.prompt_tokens_total += prompt_tokens
        self.cached_prompt_tokens_total += cached_tokens
        self.generation_tokens_total += completion_tokens
        if ttft is not None:
            self.ttft.observe(ttft)
        if decode_seconds is not None and completion_tokens > 1:
            self.tpot.observe(decode_seconds / (completion_tokens - 1))

    def render(self, in_flight: int) -> str:
        s = self.stats
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)

        def gauge(name: str, help_: str, value: int | float) -> None:
            metric(name, "gauge", help_, [f"{name} {value}"])

        gauge("minisgl_num_running_requests", "Requests being decoded.", s.num_running if s else 0)
        gauge(
            "minisgl_num_queued_requests", "Requests waiting for prefill.", s.num_queued if s else 0
        )
        gauge("minisgl_num_inflight_requests", "Requests the API is waiting on.", in_flight)
        gauge("minisgl_kv_total_tokens", "KV pool size in tokens.", s.kv_total if s else 0)
        gauge("minisgl_kv_free_tokens", "Unused KV tokens.", s.kv_free if s else 0)
        gauge(
            "minisgl_kv_evictable_tokens",
            "Prefix-cache KV tokens nobody uses (evictable).",
            s.kv_evictable if s else 0,
        )
        gauge(
            "minisgl_kv_protected_tokens",
            "Prefix-cache KV tokens in use by running requests.",
            s.kv_protected if s else 0,
        )
        gauge(
            "minisgl_kv_private_tokens",
            "KV tokens owned by running requests outside the prefix cache.",
            s.kv_private if s else 0,
        )
        reasons = dict(self.requests_total)
        for reason in ("stop", "length", "abort", "error"):
            reasons.setdefault(reason, 0)
        metric(
            "minisgl_requests_total",
            "counter",
            "Finished requests (one per choice) by finish reason.",
            [
                f'minisgl_requests_total{{finish_reason="{r}"}} {n}'
                for r, n in sorted(reasons.items())
            ],
        )

        def counter(name: str, help_: str, value: int) -> None:
            metric(name, "counter", help_, [f"{name} {value}"])

        counter(
            "minisgl_prompt_tokens_total",
            "Prompt tokens of finished requests.",
            self.prompt_tokens_total,
        )
        counter(
            "minisgl_cached_prompt_tokens_total",
            "Prompt tokens served from the prefix cache.",
            self.cached_prompt_tokens_total,
        )
        counter(
            "minisgl_generation_tokens_total", "Generated tokens.", self.generation_tokens_total
        )
        counter(
            "minisgl_retractions_total",
            "Requests retracted under KV pressure.",
            s.retractions_total if s else 0,
        )
        metric(
            "minisgl_time_to_first_token_seconds",
            "histogram",
            "Time from request arrival to its first generated token.",
            self.ttft.lines("minisgl_time_to_first_token_seconds"),
        )
        metric(
            "minisgl_time_per_output_token_seconds",
            "histogram",
            "Mean time between generated tokens after the first, per request.",
            self.tpot.lines("minisgl_time_per_output_token_seconds"),
        )
        return "\n".join(lines) + "\n"
