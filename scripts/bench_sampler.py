"""Sampler cost per decode step, vocab 49152: greedy, top-p, and a mixed batch.

Usage: python scripts/bench_sampler.py [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minisgl.engine.batch import SampleInfo
from minisgl.engine.sampler import Sampler
from minisgl.sampling_params import SamplingParams

VOCAB = 49152


def fake_logits(batch: int, gen: torch.Generator) -> torch.Tensor:
    """Gaussian background plus 20 strong tokens per row, like a language model's."""
    x = torch.randn(batch, VOCAB, generator=gen) * 2
    for r in range(batch):
        hot = torch.randint(0, VOCAB, (20,), generator=gen)
        x[r, hot] += torch.rand(20, generator=gen) * 4 + 8
    return x


def mixed(i: int) -> SamplingParams:
    return [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, seed=i),
        SamplingParams(
            temperature=0.8,
            top_k=50,
            top_p=0.95,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            logprobs=5,
        ),
    ][i % 4]


SCENARIOS = {
    "greedy": lambda i: SamplingParams(temperature=0),
    "T=0.7 top_p=0.9": lambda i: SamplingParams(temperature=0.7, top_p=0.9),
    "mixed": mixed,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(VOCAB, torch.device("cpu"), seed=0)
    for batch in (1, 64):
        logits = fake_logits(batch, gen)
        for name, make in SCENARIOS.items():
            infos = [SampleInfo(make(i), list(range(50)), list(range(20))) for i in range(batch)]
            times = []
            for _ in range(args.iters):
                x = logits.clone()
                t = time.perf_counter()
                sampler.sample(x, infos)
                times.append(time.perf_counter() - t)
            print(
                f"B={batch:2d} {name:16s} min {min(times) * 1e3:6.2f} ms  "
                f"median {statistics.median(times) * 1e3:6.2f} ms"
            )


if __name__ == "__main__":
    main()
