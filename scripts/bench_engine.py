"""Engine speed: decode steps at several batch sizes and one long prefill, vs transformers.

    python scripts/bench_engine.py [--model PATH] [--batches 1,16,32] [--context 384]
        [--dtypes float32,bfloat16] [--pack on|off|both] [--page-size 16]

Decode batches read ``--context`` cached tokens per request (the KV pool is filled with
random values; slot numbers are shuffled pages, as after cache churn). transformers runs
the same weights in float32 with its own KV cache (``model(input_ids=next, cache=...)``).
Reported times are medians over ``--steps`` timed steps after warm-up.
"""

from __future__ import annotations

import argparse
import inspect
import pathlib
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from minisgl.engine import engine as engine_module
from minisgl.engine.batch import Batch, SampleInfo
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _median_ms(fn, steps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


class _Pages:
    """Shuffled page assignment for ``rows`` requests of up to ``length`` tokens."""

    def __init__(self, engine: Engine, rows: int, length: int, seed: int = 0) -> None:
        ps = engine.page_size
        per_row = -(-length // ps)
        pages = list(range(engine.num_pages))
        random.Random(seed).shuffle(pages)
        self.table = torch.zeros(rows, per_row * ps, dtype=torch.int32)
        offsets = torch.arange(ps, dtype=torch.int32)
        for r in range(rows):
            row_pages = torch.tensor([pages.pop() for _ in range(per_row)], dtype=torch.int32)
            self.table[r] = (row_pages[:, None] * ps + offsets).view(-1)


def bench_decode(engine: Engine, batch: int, context: int, steps: int) -> float:
    pages = _Pages(engine, batch, context + steps + 4)
    vocab = engine.model_config.vocab_size
    state = {"len": context}

    def step() -> None:
        n = state["len"]
        out_loc = pages.table[:, n].long()
        info = SampleInfo(GREEDY, [0], [])
        engine.forward(
            Batch(
                table_idx=list(range(batch)),
                cached_len=[n] * batch,
                device_len=[n + 1] * batch,
                input_ids=[random.randrange(vocab) for _ in range(batch)],
                out_loc=out_loc,
                page_table=pages.table,
                sample=[info] * batch,
            )
        )
        state["len"] = n + 1

    return _median_ms(step, steps)


def bench_prefill(engine: Engine, length: int, repeats: int) -> float:
    pages = _Pages(engine, 1, length)
    ids = [random.randrange(engine.model_config.vocab_size) for _ in range(length)]
    batch = Batch(
        table_idx=[0],
        cached_len=[0],
        device_len=[length],
        input_ids=ids,
        out_loc=pages.table[0, :length].long(),
        page_table=pages.table,
        sample=[SampleInfo(GREEDY, ids, [])],
    )
    return _median_ms(lambda: engine.forward(batch), repeats, warmup=1)


def hf_model(engine: Engine):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        engine.model_path, dtype=torch.float32
    )
    return model.eval()


@torch.inference_mode()
def hf_decode(model, batch: int, context: int, steps: int) -> float:
    from transformers import DynamicCache

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    shape = (batch, cfg.num_key_value_heads, context, head_dim)
    for layer in range(cfg.num_hidden_layers):
        cache.update(
            torch.randn(shape, dtype=model.dtype) * 0.1,
            torch.randn(shape, dtype=model.dtype),
            layer,
        )
    ids = torch.randint(0, cfg.vocab_size, (batch, 1))

    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"

    def step() -> None:
        nonlocal ids
        logits = model(input_ids=ids, use_cache=True, **{cache_arg: cache}).logits
        ids = logits[:, -1].argmax(-1, keepdim=True)

    return _median_ms(step, steps)


@torch.inference_mode()
def hf_prefill(model, length: int, repeats: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, length))
    return _median_ms(lambda: model(input_ids=ids, use_cache=True), repeats, warmup=1)


def bench_engine(args, dtype: str, pack: bool) -> tuple[Engine, list[tuple[str, float, int]]]:
    batches = [int(b) for b in args.batches.split(",")]
    tokens = max(batches) * (args.context + args.steps + 8) + args.prefill + 64
    engine_module.CPU_PACKED_LINEARS = pack
    engine = Engine(
        EngineConfig(
            model=args.model,
            dtype=dtype,
            device=args.device,
            attn=args.attn,
            page_size=args.page_size,
            num_pages=-(-tokens // args.page_size) * 2,
        )
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    for layer in range(engine.model_config.num_layers):
        engine.kv_cache.k_cache(layer).normal_(0, 0.1)
        engine.kv_cache.v_cache(layer).normal_()
    rows = []
    for b in batches:
        rows.append(
            (
                f"decode  batch {b:>3} ctx {args.context}",
                bench_decode(engine, b, args.context, args.steps),
                b,
            )
        )
    repeats = max(2, args.steps // 4)
    rows.append(
        (
            f"prefill 1 x {args.prefill} tokens",
            bench_prefill(engine, args.prefill, repeats),
            args.prefill,
        )
    )
    return engine, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtypes", default="float32", help="comma-separated engine dtypes")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attn", default="auto")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--context", type=int, default=384)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--pack",
        default="on",
        choices=["on", "off", "both"],
        help="CPU: oneDNN pre-packed linear weights",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    packs = {"on": [True], "off": [False], "both": [True, False]}[args.pack]
    results = []
    engine = None
    for dtype in args.dtypes.split(","):
        for pack in packs:
            engine, rows = bench_engine(args, dtype, pack)
            kind = "" if engine.device.type != "cpu" else (" packed" if pack else " F.linear")
            label = dtype + kind
            results.append((label, rows))
            print(f"done: {label}", flush=True)
    assert engine is not None
    print(
        f"model {engine.model_path.name} ({engine.model_config.architecture}), "
        f"device {engine.device}, attn {engine.attn_name}, page_size {engine.page_size}, "
        f"threads {torch.get_num_threads()}"
    )
    hf_rows = None
    if not args.no_hf:
        hf = hf_model(engine)
        hf_rows = [hf_decode(hf, int(b), args.context, args.steps) for b in args.batches.split(",")]
        hf_rows.append(hf_prefill(hf, args.prefill, max(2, args.steps // 4)))
    head = f"{'case':<30} {'engine':<18} {'ms':>8} {'tok/s':>8}"
    if hf_rows is not None:
        head += f" {'transformers ms':>16} {'speedup':>8}"
    print(head)
    for label, rows in results:
        for i, (name, ms, n) in enumerate(rows):
            line = f"{name:<30} {label:<18} {ms:8.1f} {n / ms * 1e3:8.0f}"
            if hf_rows is not None:
                line += f" {hf_rows[i]:16.1f} {hf_rows[i] / ms:7.2f}x"
            print(line)


if __name__ == "__main__":
    main()
