"""Offline LLM on the default model: batching, radix vs naive, chunking, pressure, errors."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl import LLM, SamplingParams

SYSTEMS = [
    "You are a helpful assistant who answers questions about geography. Keep answers short, "
    "precise and friendly. Never invent facts; say when you are unsure. " * 3,
    "You are a terse math tutor. Explain each step of the computation briefly, then give the "
    "final answer on its own line. Use plain text, no LaTeX. " * 3,
    "You are a poet who writes four-line rhyming verses about everyday objects, always in a "
    "cheerful tone, and always mentioning the colour blue somewhere. " * 3,
]
QUESTIONS = [
    "What is the capital of France?",
    "Name a river in Egypt.",
    "What is 12 times 7?",
    "Write about a teapot.",
    "Where is Mount Fuji?",
    "What is the square root of 81?",
    "Write about a bicycle.",
    "Which ocean is the largest?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def chats(n: int) -> list[list[dict[str, str]]]:
    rng = random.Random(0)
    return [
        [
            {"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]},
            {"role": "user", "content": rng.choice(QUESTIONS) + f" (#{i})"},
        ]
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def radix_llm() -> LLM:
    return LLM(cache="radix", debug_invariant=True)


@pytest.fixture(scope="module")
def alone_outputs(radix_llm: LLM) -> list[list[int]]:
    naive = LLM(cache="naive", max_running_requests=1)
    return [r.token_ids for r in naive.generate(chats(48), GREEDY)]


def assert_idle_exact(llm: LLM) -> None:
    llm.scheduler.check_idle()
    s = llm.scheduler.stats().kv
    assert s.free + s.evictable == s.total


def test_paris(radix_llm: LLM) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = radix_llm.generate([msgs], SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_radix_naive_and_alone_identical(radix_llm: LLM, alone_outputs: list[list[int]]) -> None:
    prompts = chats(48)
    radix = radix_llm.generate(prompts, GREEDY)
    naive = LLM(cache="naive").generate(prompts, GREEDY)
    assert [r.token_ids for r in radix] == [r.token_ids for r in naive] == alone_outputs
    prompt_tokens = sum(r.prompt_tokens for r in radix)
    cached = sum(r.cached_tokens for r in radix)
    assert cached > 0.5 * prompt_tokens
    assert all(r.cached_tokens == 0 for r in naive)
    assert_idle_exact(radix_llm)


def test_pressure_retracts_with_identical_output(alone_outputs: list[list[int]]) -> None:
    llm = LLM(cache="radix", num_pages=1200, debug_invariant=True)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = llm.generate(chats(48), params)
    assert [r.token_ids for r in out] == alone_outputs
    assert llm.scheduler.retractions_total >= 1
    assert_idle_exact(llm)


def test_chunked_prefill_identical(radix_llm: LLM) -> None:
    rng = random.Random(3)
    vocab = radix_llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(300)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    chunked = LLM(cache="naive", max_prefill_length=32).generate(prompts, params)
    whole = radix_llm.generate(prompts, params)
    assert [r.token_ids for r in chunked] == [r.token_ids for r in whole]


def test_prompt_larger_than_pool_errors_alone() -> None:
    llm = LLM(num_pages=600)
    prompts = [*chats(3), list(range(1000, 1700))]
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert out[3].finish_reason == "error" and "pool" in (out[3].error or "")
    assert all(r.finish_reason in ("stop", "length") and r.token_ids for r in out[:3])
    assert_idle_exact(llm)


def test_stop_strings_and_prompt_forms(radix_llm: LLM) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = radix_llm.generate([msgs], SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in full.text
    cut = radix_llm.generate([msgs], SamplingParams(temperature=0, max_tokens=32, stop=["Paris"]))
    assert cut[0].finish_reason == "stop"
    assert cut[0].text == full.text[: full.text.index("Paris")]
    ids = radix_llm.encode(msgs)
    by_ids = radix_llm.generate([ids], SamplingParams(temperature=0, max_tokens=32))[0]
    assert by_ids.token_ids == full.token_ids
    text = radix_llm.generate(["The capital of France is"], SamplingParams(max_tokens=4))[0]
    assert text.prompt_tokens == len(radix_llm.tokenizer.encode("The capital of France is"))


def test_streaming_matches_generate(radix_llm: LLM) -> None:
    prompts = chats(4)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    texts = [""] * 4
    finished = [0] * 4
    for d in radix_llm.stream(prompts, params):
        texts[d.index] += d.text
        finished[d.index] += d.finished
    assert finished == [1, 1, 1, 1]
    assert texts == [r.text for r in radix_llm.generate(prompts, params)]


def test_bfloat16_kv_cache_under_float32_model() -> None:
    """The opt-in compact KV cache: a bf16 pool read by float32 attention still answers
    correctly, serves a batch and leaves the cache invariant exact."""
    llm = LLM(kv_dtype="bfloat16", num_pages=2048, debug_invariant=True)
    assert llm.engine.kv_cache.dtype == torch.bfloat16
    assert llm.engine.dtype == torch.float32
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.generate([msgs], SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.text
    results = llm.generate(chats(8), GREEDY)
    assert all(r.finish_reason in ("stop", "length") and r.token_ids for r in results)
    assert_idle_exact(llm)
