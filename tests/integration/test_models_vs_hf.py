"""Our model implementations vs ``transformers`` on tiny random-weight checkpoints.

Each architecture is built from a ``transformers`` config, given random weights, saved with
``save_pretrained`` and loaded by our ``Engine``; logits must match ``transformers``' own
forward in float32 for one batched prefill and for prefix prefill + rest prefill + decode
steps, with page sizes 1 and 16 and shuffled (non-contiguous) slot assignment.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from minisgl.engine.batch import Batch, SampleInfo
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.models.loader import ModelLoadError
from minisgl.sampling_params import SamplingParams

ATOL = 1e-4
RTOL = 1e-4
VOCAB = 301
MAX_SEQ = 128

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=72,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

ARCHS = {
    "llama": lambda: transformers.LlamaConfig(
        **COMMON,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        rope_theta=500.0,
    ),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, rope_theta=1000.0),
    "qwen3": lambda: transformers.Qwen3Config(
        **COMMON, head_dim=16, tie_word_embeddings=True, rope_theta=10000.0
    ),
    "mistral": lambda: transformers.MistralConfig(
        **COMMON,
        sliding_window=None,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_theta=100.0,
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.15 * noise)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny_model(request, tmp_path_factory):
    """(architecture name, checkpoint dir, the transformers model on the same weights)."""
    name = request.param
    config = ARCHS[name]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=sorted(ARCHS).index(name))
    model.eval()
    path = tmp_path_factory.mktemp(f"tiny-{name}")
    model.save_pretrained(path, safe_serialization=True)
    return name, path, model


class SlotAllocator:
    """Test stand-in for the CacheManager: pages handed out from a shuffled free list."""

    def __init__(self, num_pages: int, page_size: int, rows: int, seed: int = 0) -> None:
        self.page_size = page_size
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.page_table = torch.full((rows, MAX_SEQ), -1, dtype=torch.int32)
        self.lens = [0] * rows

    def allocate(self, row: int, n: int) -> list[int]:
        slots = []
        for pos in range(self.lens[row], self.lens[row] + n):
            if pos % self.page_size == 0:
                page = self.free.pop()
            else:
                page = int(self.page_table[row, pos - 1]) // self.page_size
            slot = page * self.page_size + pos % self.page_size
            self.page_table[row, pos] = slot
            slots.append(slot)
        self.lens[row] += n
        return slots


def make_batch(alloc: SlotAllocator, rows: list[int], chunks: list[list[int]]) -> Batch:
    """A batch extending each ``rows[i]`` by the tokens ``chunks[i]``."""
    cached = [alloc.lens[r] for r in rows]
    out_loc: list[int] = []
    for r, chunk in zip(rows, chunks, strict=True):
        out_loc += alloc.allocate(r, len(chunk))
    return Batch(
        table_idx=list(rows),
        cached_len=cached,
        device_len=[alloc.lens[r] for r in rows],
        input_ids=[t for chunk in chunks for t in chunk],
        out_loc=torch.tensor(out_loc, dtype=torch.int64),
        page_table=alloc.page_table,
        sample=[None] * len(rows),
    )


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def _engine(path, page_size: int) -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device="cpu",
            page_size=page_size,
            num_pages=512 // page_size,
            attn="torch",
            max_seq_len=MAX_SEQ,
        )
    )


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (7, 19, 33)]


def test_batched_prefill_matches_hf(tiny_model):
    name, path, model = tiny_model
    engine = _engine(path, page_size=1)
    prompts = _prompts(1)
    alloc = SlotAllocator(engine.num_pages, engine.page_size, rows=4, seed=1)
    batch = make_batch(alloc, [2, 0, 3], prompts)
    ours = engine.forward_logits(batch, all_positions=True)
    ref = torch.cat([hf_logits(model, p) for p in prompts])
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
    last = engine.forward_logits(make_batch(alloc, [1], [prompts[0]]))
    torch.testing.assert_close(last, hf_logits(model, prompts[0])[-1:], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_rest_and_decode_match_hf(tiny_model, page_size):
    name, path, model = tiny_model
    engine = _engine(path, page_size=page_size)
    rng = random.Random(page_size)
    prompts = _prompts(2)
    steps = 5
    full = [p + [rng.randrange(VOCAB) for _ in range(steps)] for p in prompts]
    refs = [hf_logits(model, f) for f in full]
    alloc = SlotAllocator(engine.num_pages, page_size, rows=3, seed=page_size)
    rows = [1, 2, 0]
    prefix = [3, 17, 16]

    got = engine.forward_logits(
        make_batch(alloc, rows, [p[:k] for p, k in zip(prompts, prefix, strict=True)])
    )
    want = torch.stack([r[k - 1] for r, k in zip(refs, prefix, strict=True)])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)

    rest = make_batch(alloc, rows, [p[k:] for p, k in zip(prompts, prefix, strict=True)])
    got = engine.forward_logits(rest, all_positions=True)
    want = torch.cat([r[k : len(p)] for r, k, p in zip(refs, prefix, prompts, strict=True)])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)

    for step in range(steps):
        pos = [len(p) + step for p in prompts]
        batch = make_batch(alloc, rows, [[f[i]] for f, i in zip(full, pos, strict=True)])
        assert batch.is_decode
        got = engine.forward_logits(batch)
        want = torch.stack([r[i] for r, i in zip(refs, pos, strict=True)])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_mixed_prefill_and_decode_batch(tiny_model):
    """One batch holding a decode step, a prefix-cached prefill and a fresh prefill."""
    name, path, model = tiny_model
    engine = _engine(path, page_size=16)
    prompts = _prompts(3)
    refs = [hf_logits(model, p) for p in prompts]
    alloc = SlotAllocator(engine.num_pages, 16, rows=3, seed=7)
    engine.forward_logits(make_batch(alloc, [0, 1], [prompts[0][:-1], prompts[1][:5]]))
    batch = make_batch(alloc, [0, 1, 2], [prompts[0][-1:], prompts[1][5:], prompts[2]])
    got = engine.forward_logits(batch, all_positions=True)
    want = torch.cat([refs[0][-1:], refs[1][5:], refs[2]])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_forward_samples_only_requests_with_sample_info(tiny_model):
    """Greedy ``forward``: one token per request that samples (a non-final prefill chunk
    samples nothing), equal to the argmax of transformers' logits."""
    name, path, model = tiny_model
    engine = _engine(path, page_size=4)
    prompts = _prompts(4)
    alloc = SlotAllocator(engine.num_pages, 4, rows=3, seed=4)
    batch = make_batch(alloc, [0, 1, 2], [prompts[0], prompts[1][:10], prompts[2]])
    greedy = SamplingParams(temperature=0.0)
    batch.sample = [SampleInfo(greedy, prompts[0], []), None, SampleInfo(greedy, prompts[2], [])]
    out = engine.forward(batch)
    want = [int(hf_logits(model, p)[-1].argmax()) for p in (prompts[0], prompts[2])]
    assert out.next_token_ids == want


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    config = transformers.LlamaConfig(**COMMON)
    config.architectures = ["FancyNewForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        Engine(EngineConfig(model=str(tmp_path), device="cpu", num_pages=8))
    msg = str(err.value)
    assert "FancyNewForCausalLM" in msg
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert arch in msg


def test_eos_ids_and_max_seq_len(tiny_model):
    name, path, model = tiny_model
    gen = path / "generation_config.json"
    data = json.loads(gen.read_text()) if gen.exists() else {}
    engine = _engine(path, page_size=1)
    assert engine.max_seq_len == MAX_SEQ
    expected = set()
    for value in (model.config.eos_token_id, data.get("eos_token_id")):
        if value is not None:
            expected |= set(value) if isinstance(value, list) else {value}
    assert engine.eos_token_ids == frozenset(expected)


def _tp_worker(rank: int, path: str, init: str, out: str) -> None:
    engine = Engine(
        EngineConfig(
            model=path,
            dtype="float32",
            device="cpu",
            page_size=4,
            num_pages=64,
            attn="torch",
            max_seq_len=MAX_SEQ,
            tp_rank=rank,
            tp_size=2,
            dist_init_method=init,
        )
    )
    logits = _prefill_then_decode(engine)
    torch.save(logits, f"{out}.{rank}")
    torch.distributed.destroy_process_group()


def _prefill_then_decode(engine: Engine) -> torch.Tensor:
    prompts = _prompts(5)
    alloc = SlotAllocator(engine.num_pages, engine.page_size, rows=3, seed=5)
    out = [engine.forward_logits(make_batch(alloc, [0, 1, 2], prompts), all_positions=True)]
    for step in range(3):
        out.append(engine.forward_logits(make_batch(alloc, [0, 1, 2], [[step], [7], [VOCAB - 1]])))
    return torch.cat(out)


TP_CONFIGS = {
    "gqa_tied": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True),
    "replicated_kv_bias": lambda: transformers.LlamaConfig(
        **{**COMMON, "num_key_value_heads": 1}, attention_bias=True, mlp_bias=True
    ),
}


@pytest.mark.parametrize("name", sorted(TP_CONFIGS))
def test_tensor_parallel_2_matches_tp_1(name, tmp_path):
    """Two gloo ranks (vocab, heads, KV heads and MLP split) give the single-rank logits."""
    model = transformers.AutoModelForCausalLM.from_config(TP_CONFIGS[name](), dtype=torch.float32)
    _randomize(model, seed=11)
    model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    expected = _prefill_then_decode(_engine(tmp_path / "ckpt", page_size=4))
    out = str(tmp_path / "logits")
    init = f"file://{tmp_path / 'rendezvous'}"
    torch.multiprocessing.spawn(_tp_worker, args=(str(tmp_path / "ckpt"), init, out), nprocs=2)
    for rank in range(2):
        torch.testing.assert_close(torch.load(f"{out}.{rank}"), expected, atol=ATOL, rtol=RTOL)
