"""Serving speed of ``python -m minisgl`` over HTTP: start-up time, then for each concurrency
level the time to first token, the inter-token latency of each stream and the aggregate
output tokens/s.

    python scripts/bench_server.py [--streams 1,8,16] [--max-tokens 128] [-- server flags...]

Every stream is a streamed chat completion with ``ignore_eos`` and a distinct prompt, so
each request decodes exactly ``--max-tokens`` tokens (counted from the usage chunk).
Needs the test extras (httpx).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx


@dataclass
class StreamResult:
    ttft: float
    gaps: list[float]
    tokens: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit("server did not become healthy in time")


async def one_stream(
    client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int
) -> StreamResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell me a long story about dragon {i}."}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return StreamResult(stamps[0] - start if stamps else float("nan"), gaps, tokens)


async def run_level(url: str, model: str, streams: int, max_tokens: int) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one_stream(client, url, model, i, max_tokens) for i in range(streams))
        )
        wall = time.perf_counter() - start
    gaps = sorted(g for r in results for g in r.gaps)
    tokens = sum(r.tokens for r in results)
    p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else float("nan")
    ttft = statistics.median(r.ttft for r in results)
    print(
        f"{streams:3d} streams: TTFT median {ttft * 1e3:7.0f} ms"
        f" | inter-token median {statistics.median(gaps) * 1e3:6.1f} ms, p99 {p99 * 1e3:6.1f} ms"
        f" | {tokens} tokens in {wall:6.1f} s = {tokens / wall:6.1f} tok/s",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--streams", default="1,8,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("server_args", nargs="*", help="extra flags for python -m minisgl (after --)")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisgl", "--port", str(port), *args.server_args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(url, proc)
        print(f"start-up to healthy: {time.monotonic() - started:.1f} s", flush=True)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        asyncio.run(run_level(url, model, 2, 16))  # warm-up: kernels, allocator, first pages
        for n in (int(s) for s in args.streams.split(",")):
            asyncio.run(run_level(url, model, n, args.max_tokens))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
