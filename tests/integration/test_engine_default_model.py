"""The built-in default model (SmolLM2-135M-Instruct): greedy decoding through our engine is
token-identical to ``transformers.generate`` on the same dequantized weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from minisgl.engine.batch import Batch, SampleInfo
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.models.loader import resolve_model_path
from minisgl.sampling_params import SamplingParams

NEW_TOKENS = 32
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a CPU does.",
    "Hi!",
]


@pytest.fixture(scope="module")
def model_path():
    return resolve_model_path(None)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return transformers.AutoTokenizer.from_pretrained(model_path)


def chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


def generate(engine: Engine, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuous decoding of all prompts together (one batched prefill, then decode
    steps over the unfinished ones), slots assigned contiguously per request."""
    ps = engine.page_size
    max_len = max(len(p) for p in prompts) + max_new
    pages_per_row = -(-max_len // ps)
    table = torch.zeros(len(prompts), pages_per_row * ps, dtype=torch.int32)
    for row in range(len(prompts)):
        table[row] = torch.arange(row * pages_per_row * ps, (row + 1) * pages_per_row * ps)
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    outputs: list[list[int]] = [[] for _ in prompts]
    lens = [0] * len(prompts)
    active = list(range(len(prompts)))
    chunks = [list(p) for p in prompts]
    while active:
        cached = [lens[r] for r in active]
        device = [lens[r] + len(chunks[r]) for r in active]
        batch = Batch(
            table_idx=active,
            cached_len=cached,
            device_len=device,
            input_ids=[t for r in active for t in chunks[r]],
            out_loc=torch.cat(
                [table[r, c:d].long() for r, c, d in zip(active, cached, device, strict=True)]
            ),
            page_table=table,
            sample=[SampleInfo(params, prompts[r], outputs[r]) for r in active],
        )
        next_ids = engine.forward(batch).next_token_ids
        still = []
        for r, d, tok in zip(active, device, next_ids, strict=True):
            lens[r] = d
            outputs[r].append(tok)
            chunks[r] = [tok]
            if tok not in engine.eos_token_ids and len(outputs[r]) < max_new:
                still.append(r)
        active = still
    return outputs


def test_greedy_matches_transformers_generate(model_path, tokenizer):
    engine = Engine(EngineConfig(device="cpu", dtype="float32", page_size=16, num_pages=256))
    assert engine.model_path == model_path
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    ours = generate(engine, prompts, NEW_TOKENS)

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    hf.eval()
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                pad_token_id=tokenizer.eos_token_id,
            )
        want = out[0, len(prompt) :].tolist()
        assert got == want, (tokenizer.decode(got), tokenizer.decode(want))

    answer = tokenizer.decode(ours[0], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_engine_properties(model_path):
    engine = Engine(EngineConfig(device="cpu", num_pages=64))
    assert engine.dtype == torch.float32
    assert engine.max_seq_len == 8192
    assert 2 in engine.eos_token_ids
    assert engine.model_config.tie_word_embeddings
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
