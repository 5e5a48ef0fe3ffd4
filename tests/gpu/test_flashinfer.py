"""FlashInfer backend vs the torch backend on the same paged pool (CUDA only)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from minisgl.attention import AttentionConfig, create_backend
from minisgl.engine.batch import Batch
from minisgl.kvcache.mha_pool import MHAKVCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 8, 2, 128, 2
MAX_SEQ = 512
CASES = {
    "decode": [(0, 1), (100, 1), (37, 1), (300, 1)],
    "prefill": [(0, 50), (64, 30), (17, 1), (0, 200)],
}


def _setup(name: str, page_size: int, dtype: torch.dtype):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    pool = MHAKVCache(LAYERS, 4096 // page_size, page_size, KV_HEADS, HEAD_DIM, dtype, dev)
    for layer in range(LAYERS):
        pool.k_cache(layer).normal_()
        pool.v_cache(layer).normal_()
    config = AttentionConfig(HEADS, KV_HEADS, HEAD_DIM, page_size, dev, dtype, HEAD_DIM**-0.5)
    return pool, create_backend(name, config, pool), create_backend("torch", config, pool)


def _batch(pool: MHAKVCache, lens: list[tuple[int, int]], seed: int) -> Batch:
    rng = random.Random(seed)
    pages = list(range(pool.num_pages))
    rng.shuffle(pages)
    ps = pool.page_size
    table = torch.zeros(len(lens), MAX_SEQ, dtype=torch.int32)
    out_loc = []
    for row, (cached, ext) in enumerate(lens):
        for pos in range(cached + ext):
            if pos % ps == 0:
                page = pages.pop()
            table[row, pos] = page * ps + pos % ps
        out_loc += table[row, cached : cached + ext].tolist()
    return Batch(
        table_idx=list(range(len(lens))),
        cached_len=[c for c, _ in lens],
        device_len=[c + e for c, e in lens],
        input_ids=[0] * sum(e for _, e in lens),
        out_loc=torch.tensor(out_loc, dtype=torch.int64),
        page_table=table,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_flashinfer_matches_torch_backend(case, page_size, dtype):
    pool, fi, ref = _setup("flashinfer", page_size, dtype)
    batch = _batch(pool, CASES[case], seed=page_size)
    md_fi, md_ref = fi.prepare(batch), ref.prepare(batch)
    for layer in range(LAYERS):
        q = torch.randn(len(batch.input_ids), HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        got = fi.forward(q, layer, pool, md_fi).reshape(q.shape).float()
        want = ref.forward(q, layer, pool, md_ref).reshape(q.shape).float()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_decode_cuda_graph_replay(page_size):
    pool, fi, ref = _setup("flashinfer", page_size, torch.bfloat16)
    bs = 4
    fi.init_cuda_graph(bs)
    md = fi.prepare_for_capture(bs)
    q = torch.zeros(bs, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    fi.forward(q, 0, pool, md)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fi.forward(q, 0, pool, md)
    for seed in range(2):
        batch = _batch(pool, [(10 + 50 * seed, 1), (3, 1), (200, 1), (64, 1)], seed=seed)
        fi.prepare_for_replay(batch, md)
        q.copy_(torch.randn_like(q))
        graph.replay()
        want = ref.forward(q, 0, pool, ref.prepare(batch)).reshape(q.shape)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_hybrid_flashinfer_prefill_torch_decode():
    pool, hybrid, ref = _setup("flashinfer,torch", 16, torch.bfloat16)
    for case in sorted(CASES):
        batch = _batch(pool, CASES[case], seed=3)
        q = torch.randn(len(batch.input_ids), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        got = hybrid.forward(q, 1, pool, hybrid.prepare(batch)).reshape(q.shape)
        want = ref.forward(q, 1, pool, ref.prepare(batch)).reshape(q.shape)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_engine_flashinfer_matches_torch_backend(tmp_path):
    """A tiny Llama on CUDA: logits with attn=flashinfer equal attn=torch (bf16 tolerance)."""
    import transformers

    from minisgl.engine.config import EngineConfig
    from minisgl.engine.engine import Engine
    from tests.integration.test_models_vs_hf import COMMON, SlotAllocator, _randomize, make_batch

    config = transformers.LlamaConfig(**{**COMMON, "head_dim": 64, "hidden_size": 256})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    prompts = [[(7 * i + j) % 300 for j in range(n)] for i, n in enumerate((5, 40, 17))]
    results = []
    for attn in ("flashinfer", "torch"):
        engine = Engine(
            EngineConfig(
                model=str(tmp_path),
                device="cuda",
                dtype="bfloat16",
                attn=attn,
                page_size=16,
                num_pages=64,
                max_seq_len=128,
            )
        )
        alloc = SlotAllocator(engine.num_pages, 16, rows=3, seed=1)
        out = [engine.forward_logits(make_batch(alloc, [0, 1, 2], prompts), all_positions=True)]
        for step in range(4):
            batch = make_batch(alloc, [0, 1, 2], [[step], [step + 1], [step + 2]])
            out.append(engine.forward_logits(batch))
        results.append(torch.cat(out))
    torch.testing.assert_close(results[0], results[1], atol=5e-2, rtol=5e-2)
