"""Engine speed: decode steps at several batch sizes and one long prefill, vs transformers.

    python scripts/bench_engine.py [--model PATH] [--batches 1,16,32] [--context 384]
        [--dtypes float32,bfloat16] [--weight-dtypes auto,bfloat16] [--pack on|off|both]
        [--page-sizes 1,16] [--no-hf] [--stat median|min]

Decode batches read ``--context`` cached tokens per request (the KV pool is filled with
random values; slots come from shuffled pages, as after cache churn) and sample greedily.
transformers runs the same weights in float32 with its own KV cache
(``model(input_ids=next_tokens, cache=...)``). All variants of a case are timed round-robin,
one step each per round, so drifting machine load hits them alike; times are medians
(``--stat min``: minima, an estimate of the unloaded time on a shared machine).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import pathlib
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from minisgl.engine import engine as engine_module
from minisgl.engine.batch import Batch, SampleInfo
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def page_table(engine: Engine, rows: int, length: int, seed: int = 0) -> torch.Tensor:
    """Rows of ``length`` token slots built from shuffled pages of the engine's pool."""
    ps = engine.page_size
    per_row = -(-length // ps)
    pages = torch.randperm(engine.num_pages, generator=torch.Generator().manual_seed(seed))
    pages = pages[: rows * per_row].to(torch.int32).view(rows, per_row, 1)
    return (pages * ps + torch.arange(ps, dtype=torch.int32)).view(rows, per_row * ps)


def decode_step(engine: Engine, batch: int, context: int, steps: int) -> Callable[[], None]:
    table = page_table(engine, batch, context + steps + 1)
    vocab = engine.model_config.vocab_size
    state = {"len": context}
    info = SampleInfo(GREEDY, [0], [])

    def step() -> None:
        n = state["len"]
        if n + 1 >= table.shape[1]:
            n = context
        engine.forward(
            Batch(
                table_idx=list(range(batch)),
                cached_len=[n] * batch,
                device_len=[n + 1] * batch,
                input_ids=[random.randrange(vocab) for _ in range(batch)],
                out_loc=table[:, n].long(),
                page_table=table,
                sample=[info] * batch,
            )
        )
        state["len"] = n + 1

    return step


def prefill_step(engine: Engine, length: int) -> Callable[[], None]:
    table = page_table(engine, 1, length, seed=1)
    ids = [random.randrange(engine.model_config.vocab_size) for _ in range(length)]
    batch = Batch(
        table_idx=[0],
        cached_len=[0],
        device_len=[length],
        input_ids=ids,
        out_loc=table[0, :length].long(),
        page_table=table,
        sample=[SampleInfo(GREEDY, ids, [])],
    )
    return lambda: engine.forward(batch)


def hf_decode_step(model, batch: int, context: int) -> Callable[[], None]:
    from transformers import DynamicCache

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (batch, cfg.num_key_value_heads, context, head_dim)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else None
    cache_arg = cache_arg or "past_key_values"

    def fresh_cache():
        cache = DynamicCache(config=cfg)
        for layer in range(cfg.num_hidden_layers):
            cache.update(torch.randn(shape) * 0.1, torch.randn(shape), layer)
        return cache

    state = {"cache": fresh_cache(), "ids": torch.randint(0, cfg.vocab_size, (batch, 1)), "n": 0}

    @torch.inference_mode()
    def step() -> None:
        if state["n"] == 64:
            state["cache"], state["n"] = fresh_cache(), 0
        out = model(input_ids=state["ids"], use_cache=True, **{cache_arg: state["cache"]})
        state["ids"] = out.logits[:, -1].argmax(-1, keepdim=True)
        state["n"] += 1

    return step


def hf_prefill_step(model, length: int) -> Callable[[], None]:
    ids = torch.randint(0, model.config.vocab_size, (1, length))

    @torch.inference_mode()
    def step() -> None:
        model(input_ids=ids, use_cache=True)

    return step


def round_robin(
    steps: dict[str, Callable[[], None]], rounds: int, warmup: int = 2, stat: str = "median"
) -> dict[str, float]:
    """Milliseconds per variant (median or min over rounds), one call of each per round."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    reduce = min if stat == "min" else statistics.median
    return {name: reduce(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtypes", default="float32", help="comma-separated engine dtypes")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attn", default="auto")
    parser.add_argument("--page-sizes", default="1", help="comma-separated page sizes")
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--context", type=int, default=384)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10, help="timed rounds per case")
    parser.add_argument(
        "--pack", default="on", choices=["on", "off", "both"], help="CPU: oneDNN packed linears"
    )
    parser.add_argument(
        "--weight-dtypes",
        default="auto",
        help="comma-separated CPU weight storage dtypes for float32 engines (auto, bfloat16)",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--stat",
        default="median",
        choices=["median", "min"],
        help="min estimates the unloaded time on a shared machine",
    )
    args = parser.parse_args()

    batches = [int(b) for b in args.batches.split(",")]
    tokens = max(batches) * (args.context + args.steps + 8) + args.prefill
    engines: dict[str, Engine] = {}
    page_sizes = [int(p) for p in args.page_sizes.split(",")]
    packs = {"on": [True], "off": [False], "both": [True, False]}[args.pack]
    variants = itertools.product(
        args.dtypes.split(","), args.weight_dtypes.split(","), packs, page_sizes
    )
    for dtype, wdtype, pack, ps in variants:
        if wdtype != "auto" and dtype != "float32":
            continue
        engine_module.CPU_PACKED_LINEARS = pack
        engine = Engine(
            EngineConfig(
                model=args.model,
                dtype=dtype,
                weight_dtype=wdtype,
                device=args.device,
                attn=args.attn,
                page_size=ps,
                num_pages=-(-tokens // ps) + 8,
            )
        )
        for layer in range(engine.model_config.num_layers):
            engine.kv_cache.k_cache(layer).normal_(0, 0.1)
            engine.kv_cache.v_cache(layer).normal_()
        label = dtype if wdtype == "auto" else f"{dtype} w:{wdtype}"
        if engine.device.type == "cpu" and len(packs) > 1:
            label += " packed" if pack else " F.linear"
        if len(page_sizes) > 1:
            label += f" ps{ps}"
        engines[label] = engine
    if args.threads:
        torch.set_num_threads(args.threads)
    hf = None
    if not args.no_hf:
        import transformers

        path = next(iter(engines.values())).model_path
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    first = next(iter(engines.values()))
    print(
        f"model {first.model_path.name} ({first.model_config.architecture}), device "
        f"{first.device}, attn {first.attn_name}, page sizes {args.page_sizes}, "
        f"threads {torch.get_num_threads()}"
    )
    print(f"{'case':<28} {'variant':<24} {'ms':>9} {'tok/s':>8} {'vs transformers':>16}")
    cases = [(f"decode  B={b:<3} ctx {args.context}", b) for b in batches]
    cases.append((f"prefill 1 x {args.prefill}", None))
    for name, b in cases:
        steps = {}
        for label, engine in engines.items():
            if b is None:
                steps[label] = prefill_step(engine, args.prefill)
            else:
                steps[label] = decode_step(engine, b, args.context, args.steps + 4)
        if hf is not None:
            steps["transformers fp32"] = (
                hf_prefill_step(hf, args.prefill)
                if b is None
                else hf_decode_step(hf, b, args.context)
            )
        rounds = args.steps if b is not None else max(3, args.steps // 3)
        result = round_robin(steps, rounds, 2 if b is not None else 1, args.stat)
        tokens_per_call = b if b is not None else args.prefill
        base = result.get("transformers fp32")
        for label, ms in result.items():
            ratio = f"{base / ms:15.2f}x" if base is not None else f"{'-':>16}"
            print(f"{name:<28} {label:<24} {ms:9.1f} {tokens_per_call / ms * 1e3:8.0f} {ratio}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
