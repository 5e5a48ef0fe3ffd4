"""Offline throughput of minisgl against transformers ``generate`` on the same workload.

Usage: python scripts/bench_offline.py [--num-requests 64] [--skip-hf] [--hf-batch 16 32]
    [--skip-mixed] [--skip-prefix]

Workload (fixed seed): random token prompts of 100-1024 tokens, 100-512 output tokens each,
ignore_eos. The same workload runs with mixed batches (default) and with prefill and decode
batches alternating (``mixed=False``). A last part compares the radix and naive caches on a
shared-prefix workload.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from minisgl import LLM, SamplingParams


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(100, vocab - 100) for _ in range(rng.randint(100, 1024))],
            rng.randint(100, 512),
        )
        for _ in range(n)
    ]


def bench_minisgl(llm: LLM, work: list[tuple[list[int], int]]) -> tuple[float, int]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work]
    t = time.perf_counter()
    out = llm.generate([p for p, _ in work], params)
    dt = time.perf_counter() - t
    return dt, sum(len(r.token_ids) for r in out)


def bench_hf(model_path: str, work: list[tuple[list[int], int]], batch: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    pad = model.config.eos_token_id or 0
    t = time.perf_counter()
    total = 0
    with torch.inference_mode():
        for i in range(0, len(work), batch):
            group = work[i : i + batch]
            width = max(len(p) for p, _ in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
            new = max(m for _, m in group)
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
            total += sum(m for _, m in group)  # tokens the requests asked for
    return time.perf_counter() - t, total


def bench_prefix(llm_factory, n: int = 64) -> None:
    rng = random.Random(1)
    vocab = 40000
    systems = [[rng.randrange(100, vocab) for _ in range(800)] for _ in range(4)]
    prompts = [
        rng.choice(systems) + [rng.randrange(100, vocab) for _ in range(40)] for _ in range(n)
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for cache in ("radix", "naive"):
        llm = llm_factory(cache)
        t = time.perf_counter()
        llm.generate(prompts, params)
        dt = time.perf_counter() - t
        st = llm.scheduler.stats()
        print(
            f"shared-prefix {cache:5s}: {dt:7.2f} s, prefill tokens computed "
            f"{st.prefill_tokens_total} of {sum(map(len, prompts))}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--skip-mixed", action="store_true")
    ap.add_argument("--hf-batch", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--max-running", type=int, default=64)
    args = ap.parse_args()

    llm = LLM(max_running_requests=args.max_running)
    vocab = llm.engine.model_config.vocab_size
    work = workload(args.num_requests, vocab)
    dt, toks = bench_minisgl(llm, work)
    print(f"minisgl      : {toks} output tokens in {dt:7.2f} s = {toks / dt:7.1f} tok/s")
    model_path = str(llm.engine.model_path)
    del llm
    if not args.skip_mixed:
        alt = LLM(max_running_requests=args.max_running, mixed=False)
        adt, atoks = bench_minisgl(alt, work)
        del alt
        print(
            f"minisgl alternating prefill/decode: {atoks} tokens in {adt:7.2f} s = "
            f"{atoks / adt:7.1f} tok/s (mixed x{(toks / dt) / (atoks / adt):.2f})"
        )
    if not args.skip_hf:
        for b in args.hf_batch:
            hdt, htoks = bench_hf(model_path, work, b)
            print(
                f"transformers : batch {b:3d}: {htoks} tokens in {hdt:7.2f} s = "
                f"{htoks / hdt:7.1f} tok/s  (minisgl x{(toks / dt) / (htoks / hdt):.2f})"
            )
    if not args.skip_prefix:
        bench_prefix(lambda cache: LLM(cache=cache, max_running_requests=args.max_running))


if __name__ == "__main__":
    main()
