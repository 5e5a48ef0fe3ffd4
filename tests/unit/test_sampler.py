"""Sampler: greedy, filters, penalties, seeds and log-probabilities against plain references."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from minisgl.engine.batch import SampleInfo
from minisgl.engine.sampler import (
    Sampler,
    apply_penalties,
    block_topk,
    cut_thresholds,
    fast_argmax,
)
from minisgl.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def one_thread():
    """Many small ops: a second intra-op thread only adds contention on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def info(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    banned: frozenset[int] = frozenset(),
    **params,
) -> SampleInfo:
    return SampleInfo(
        params=SamplingParams(**params),
        prompt_ids=list(prompt or [1]),
        output_ids=list(output or []),
        banned_token_ids=banned,
    )


def ref_penalized(row: list[float], sample: SampleInfo) -> list[float]:
    p = sample.params
    z = list(row)
    if p.repetition_penalty != 1.0:
        for t in set(sample.prompt_ids) | set(sample.output_ids):
            z[t] = z[t] / p.repetition_penalty if z[t] > 0 else z[t] * p.repetition_penalty
    for t, count in Counter(sample.output_ids).items():
        z[t] -= count * p.frequency_penalty + p.presence_penalty
    for t in sample.banned_token_ids:
        z[t] = -math.inf
    return z


def ref_log_softmax(z: list[float]) -> list[float]:
    m = max(z)
    lse = m + math.log(sum(math.exp(v - m) for v in z))
    return [v - lse for v in z]


def ref_distribution(z: list[float], p: SamplingParams) -> list[float]:
    """Exact sampling distribution: softmax(z / T), then top_k, top_p (renormalized), min_p."""
    m = max(z)
    e = [math.exp((v - m) / p.temperature) for v in z]
    total = sum(e)
    prob = [v / total for v in e]
    order = sorted(range(len(z)), key=lambda t: -prob[t])
    keep = order[: p.top_k] if p.top_k > 0 else order
    if p.top_p < 1.0:
        mass = sum(prob[t] for t in keep)
        cum, cut = 0.0, []
        for t in keep:
            cut.append(t)
            cum += prob[t]
            if cum >= p.top_p * mass:
                break
        keep = cut
    if p.min_p > 0.0:
        floor = p.min_p * max(prob)
        keep = [t for t in keep if prob[t] >= floor]
    mass = sum(prob[t] for t in keep)
    kept = set(keep)
    return [prob[t] / mass if t in kept else 0.0 for t in range(len(z))]


def assert_frequencies(tokens: list[int], expected: list[float]) -> None:
    """Each token's count within 5 binomial standard deviations; impossible tokens never."""
    n = len(tokens)
    counts = Counter(tokens)
    assert set(counts) <= {t for t, q in enumerate(expected) if q > 0}
    for t, q in enumerate(expected):
        sigma = math.sqrt(n * q * (1 - q))
        assert abs(counts[t] - n * q) <= 5 * sigma + 1e-9, (t, counts[t], n * q, sigma)


SMALL_LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, 3.0, 1.5, -0.5]


def test_fast_argmax_matches_torch_argmax_including_ties() -> None:
    g = torch.Generator().manual_seed(0)
    for width in (1, 5, 63, 64, 65, 130, 1000, 4096 + 17):
        x = torch.randint(-3, 4, (7, width), generator=g).float()
        assert torch.equal(fast_argmax(x), x.argmax(-1)), width
        wide = torch.randint(-3, 4, (7, width + 40), generator=g).float()
        assert torch.equal(fast_argmax(wide[:, :width]), wide[:, :width].argmax(-1)), width


def test_block_topk_values_match_torch_topk() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64 * 200, generator=g)
    for k in (1, 5, 20):
        values, ids = block_topk(x, k)
        ref = x.topk(k, -1)
        assert torch.equal(values, ref.values)
        assert torch.equal(ids, ref.indices)


def test_greedy_fast_path_ignores_padded_columns() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 200, generator=g)
    logits[:, 150:] = 100.0
    sampler = Sampler(150, torch.device("cpu"), seed=0)
    out = sampler.sample(logits, [info(temperature=0.0) for _ in range(6)])
    assert out.next_token_ids == logits[:, :150].argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_top_k_1_equals_greedy() -> None:
    g = torch.Generator().manual_seed(3)
    vocab = 1000
    logits = torch.randn(16, vocab, generator=g) * 3
    sampler = Sampler(vocab, torch.device("cpu"), seed=0)
    extra = [{}, {"presence_penalty": 1.0}, {"repetition_penalty": 1.5}, {"min_p": 0.1}]
    for params in extra:
        infos_greedy = [info(output=[i, 7, 7], temperature=0.0, **params) for i in range(16)]
        infos_top1 = [
            info(output=[i, 7, 7], temperature=1.3, top_k=1, seed=i, **params) for i in range(16)
        ]
        greedy = sampler.sample(logits, infos_greedy).next_token_ids
        assert sampler.sample(logits, infos_top1).next_token_ids == greedy


def step_logits(step: int, vocab: int, width: int) -> torch.Tensor:
    """Peaked, medium or flat logits, so cuts and draws take every path."""
    g = torch.Generator().manual_seed(1000 + step)
    row = torch.randn(width, generator=g) * (4.0, 1.5, 0.3)[step % 3]
    row[vocab:] = 50.0
    return row


TARGETS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.2, "top_k": 50, "top_p": 0.8},
    {"temperature": 0.9, "min_p": 0.05},
    {"temperature": 1.0, "top_p": 0.95, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
]


@pytest.mark.parametrize("vocab", [3000, 64 * 320])
@pytest.mark.parametrize("target", TARGETS)
def test_seed_reproducible_regardless_of_batch(target: dict, vocab: int) -> None:
    width, steps = vocab + 70, 15
    companions = [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.5, "top_k": 5, "seed": 7},
        {"temperature": 1.5, "top_p": 0.5, "logprobs": 3},
        {"temperature": 0.8, "min_p": 0.2, "presence_penalty": 1.0, "seed": 99},
        {"temperature": 1.0, "top_k": 300, "top_p": 0.99},
    ]

    def run(with_companions: bool, sampler_seed: int) -> list[int]:
        sampler = Sampler(vocab, torch.device("cpu"), seed=sampler_seed)
        rng = random.Random(sampler_seed)
        output: list[int] = []
        for step in range(steps):
            row = step_logits(step, vocab, width)
            me = info(prompt=[1, 2, 3], output=output, seed=1234, **target)
            infos, rows = [me], [row]
            if with_companions:
                for _ in range(rng.randint(1, 5)):
                    params = rng.choice(companions)
                    banned = frozenset(rng.sample(range(vocab), 3))
                    infos.append(info(output=output[:3], banned=banned, **params))
                    rows.append(torch.randn(width) * 3)
                pos = rng.randrange(len(infos))
                infos.insert(pos, infos.pop(0))
                rows.insert(pos, rows.pop(0))
            else:
                pos = 0
            out = sampler.sample(torch.stack(rows), infos)
            output = output + [out.next_token_ids[pos]]
        return output

    alone = run(False, 0)
    assert all(0 <= t < vocab for t in alone)
    assert len(set(alone)) > 1
    assert run(True, 1) == alone
    assert run(True, 2) == alone


def test_different_seeds_give_different_sequences() -> None:
    vocab = 500
    sampler = Sampler(vocab, torch.device("cpu"), seed=0)
    logits = torch.zeros(8, vocab)
    infos = [info(seed=s) for s in range(8)]
    first = sampler.sample(logits, infos).next_token_ids
    assert len(set(first)) > 4
    assert sampler.sample(logits, infos).next_token_ids == first
    later = [info(seed=s, output=[0]) for s in range(8)]
    assert sampler.sample(logits, later).next_token_ids != first


DISTRIBUTIONS = [
    {"temperature": 1.0},
    {"temperature": 0.5},
    {"temperature": 2.0},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 1.5, "top_p": 0.6},
    {"temperature": 1.0, "top_k": 3},
    {"temperature": 1.0, "top_k": 3, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 0.8, "top_k": 5, "top_p": 0.7, "min_p": 0.1},
]


@pytest.mark.parametrize("params", DISTRIBUTIONS)
@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_distribution_small_vocab(params: dict, seeded: bool) -> None:
    n, vocab = 20000, len(SMALL_LOGITS)
    logits = torch.tensor(SMALL_LOGITS).expand(n, vocab)
    sampler = Sampler(vocab, torch.device("cpu"), seed=5)
    infos = [info(seed=i if seeded else None, **params) for i in range(n)]
    tokens = sampler.sample(logits, infos).next_token_ids
    expected = ref_distribution(SMALL_LOGITS, SamplingParams(**params))
    assert_frequencies(tokens, expected)


def sample_many(
    sampler: Sampler, row: torch.Tensor, params: dict, n: int, chunk: int = 4000
) -> list[int]:
    tokens: list[int] = []
    for start in range(0, n, chunk):
        count = min(chunk, n - start)
        infos = [info(**params) for _ in range(count)]
        tokens += sampler.sample(row.expand(count, -1), infos).next_token_ids
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 1.0, "top_k": 10},
        {"temperature": 0.8, "top_p": 0.9},
        {"temperature": 1.0, "min_p": 0.02},
    ],
)
def test_empirical_distribution_blocks(params: dict) -> None:
    """40 probable tokens spread over 64 blocks; the rest negligible but not excluded."""
    n, vocab = 12000, 4096
    g = torch.Generator().manual_seed(6)
    row = torch.full((vocab,), -30.0)
    row[torch.randperm(vocab, generator=g)[:40]] = torch.randn(40, generator=g)
    tokens = sample_many(Sampler(vocab, torch.device("cpu"), seed=6), row, params, n)
    assert_frequencies(tokens, ref_distribution(row.tolist(), SamplingParams(**params)))


def test_empirical_distribution_many_kept_blocks() -> None:
    """Kept tokens in more blocks than the sparse draw takes: the dense draw."""
    n, vocab = 4000, 64 * 300
    g = torch.Generator().manual_seed(13)
    row = torch.full((vocab,), -30.0)
    hot = torch.arange(300) * 64 + torch.randint(0, 64, (300,), generator=g)
    row[hot] = torch.rand(300, generator=g)
    row[hot[::15]] += 3.0
    params = {"temperature": 1.0, "min_p": 0.01}
    tokens = sample_many(Sampler(vocab, torch.device("cpu"), seed=13), row, params, n, chunk=500)
    assert_frequencies(tokens, ref_distribution(row.tolist(), SamplingParams(**params)))


def kept_reference(w: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    p = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    z = w.double().log().tolist()
    return {t for t, q in enumerate(ref_distribution(z, p)) if q > 0}


@pytest.mark.parametrize("shape", ["peaked", "clustered", "flat"])
def test_cut_thresholds_match_full_sort(shape: str) -> None:
    """Cut found among the best blocks (peaked), with more blocks (clustered), by full sort."""
    vocab, n = 64 * 256, 3
    g = torch.Generator().manual_seed(7)
    if shape == "peaked":
        logits = torch.randn(n, vocab, generator=g) * 4
    elif shape == "clustered":
        logits = torch.randn(n, vocab, generator=g) - 25
        for r in range(n):
            blocks = torch.randperm(256, generator=g)[:100]
            cols = (blocks[:, None] * 64 + torch.randperm(64, generator=g)[:10]).flatten()
            logits[r, cols] = torch.randn(cols.numel(), generator=g) * 0.5
    else:
        logits = torch.randn(n, vocab, generator=g) * 0.3
    w = (logits - logits.amax(-1, keepdim=True)).exp()
    blocks = w.view(n, 256, 64)
    cases = [(0, 0.9), (0, 0.5), (40, 1.0), (300, 0.95), (3000, 0.7), (0, 0.999)]
    for top_k, top_p in cases:
        rows = torch.arange(n)
        thr = cut_thresholds(
            w,
            rows,
            blocks.amax(-1),
            torch.full((n,), top_k),
            torch.full((n,), top_p),
            w.sum(-1),
        )
        for r in range(n):
            kept = set((w[r] >= thr[r]).nonzero().flatten().tolist())
            assert kept == kept_reference(w[r], top_k, top_p), (shape, top_k, top_p, r)


def test_penalties_change_logits_exactly_as_defined() -> None:
    vocab = 300
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(5, vocab, generator=g) * 2
    infos = [
        info(prompt=[3, 4, 5], output=[5, 6, 6, 6, 9], presence_penalty=0.7),
        info(prompt=[3, 4, 5], output=[5, 6, 6, 6, 9], frequency_penalty=-0.4),
        info(prompt=[3, 4, 4, 5, 250], output=[5, 6, 6], repetition_penalty=1.7),
        info(
            prompt=list(range(0, 300, 7)),
            output=[1, 1, 2, 299, 14],
            repetition_penalty=0.6,
            frequency_penalty=0.5,
            presence_penalty=-1.2,
        ),
        info(prompt=[1, 2], output=[3, 3], temperature=0.5),
    ]
    x = logits.clone()
    apply_penalties(x, infos, [0, 1, 2, 3])
    for r, sample in enumerate(infos):
        expected = torch.tensor(ref_penalized(logits[r].tolist(), sample))
        torch.testing.assert_close(x[r], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(x[4], logits[4])


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0]])
    sampler = Sampler(4, torch.device("cpu"), seed=0)
    assert sampler.sample(logits, [info(output=[1], temperature=0.0)]).next_token_ids == [1]
    penalized = info(output=[1], temperature=0.0, presence_penalty=1.0)
    assert sampler.sample(logits, [penalized]).next_token_ids == [2]
    repeated = info(output=[1], temperature=0.0, repetition_penalty=1.3)
    assert sampler.sample(logits, [repeated]).next_token_ids == [2]
    assert logits.tolist() == [[1.0, 3.0, 2.5, 0.0]]


def test_logprobs_and_top_alternatives() -> None:
    vocab, width = 2000, 2048
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, width, generator=g) * 3
    infos = [
        info(temperature=0.0, logprobs=5),
        info(temperature=0.7, top_p=0.9, logprobs=0, seed=3),
        info(temperature=1.0),
        info(temperature=1.3, logprobs=20, output=[4, 4, 9], frequency_penalty=0.8),
        info(temperature=0.0, logprobs=3, banned=frozenset({int(logits[4, :vocab].argmax())})),
        info(temperature=0.0),
    ]
    original = logits.clone()
    sampler = Sampler(vocab, torch.device("cpu"), seed=9)
    out = sampler.sample(logits, infos)
    assert torch.equal(logits, original)
    assert out.logprobs is not None and out.top_logprobs is not None
    for r, sample in enumerate(infos):
        want = sample.params.logprobs
        if want is None:
            assert math.isnan(out.logprobs[r]) and out.top_logprobs[r] == []
            continue
        ref = ref_log_softmax(ref_penalized(logits[r, :vocab].tolist(), sample))
        token = out.next_token_ids[r]
        assert out.logprobs[r] == pytest.approx(ref[token], abs=1e-5)
        best = sorted(range(vocab), key=lambda t: -ref[t])[:want]
        assert [t for t, _ in out.top_logprobs[r]] == best
        values = [v for _, v in out.top_logprobs[r]]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx([ref[t] for t in best], abs=1e-5)
    assert out.next_token_ids[4] != int(logits[4, :vocab].argmax())


def test_banned_and_padded_tokens_never_sampled() -> None:
    vocab, width, n = 100, 128, 4000
    logits = torch.zeros(width)
    logits[:10] = 5.0
    logits[vocab:] = 50.0
    banned = frozenset(range(0, 10, 2))
    sampler = Sampler(vocab, torch.device("cpu"), seed=10)
    params = [{"temperature": 2.0}, {"temperature": 0.5, "top_p": 0.9}, {"temperature": 0.0}]
    for p in params:
        infos = [info(banned=banned, **p) for _ in range(n)]
        tokens = sampler.sample(logits.expand(n, width), infos).next_token_ids
        assert not banned & set(tokens)
        assert max(tokens) < vocab
        if p["temperature"] > 0:
            assert {1, 3, 5, 7, 9} <= set(tokens)


def test_logits_restored_after_in_place_penalties() -> None:
    vocab = 128
    g = torch.Generator().manual_seed(14)
    logits = torch.randn(4, vocab + 5, generator=g)
    original = logits.clone()
    infos = [
        info(output=[3, 3, 7], presence_penalty=1.5, temperature=0.0, logprobs=2),
        info(prompt=[5, 9], output=[9], repetition_penalty=1.9, banned=frozenset({0, 9})),
        info(banned=frozenset({int(logits[2, :vocab].argmax())}), temperature=0.0),
        info(temperature=0.7, top_p=0.8, frequency_penalty=2.0, output=[1, 1, 1, 200]),
    ]
    out = Sampler(vocab, torch.device("cpu"), seed=14).sample(logits, infos)
    assert torch.equal(logits, original)
    expected = ref_penalized(logits[0, :vocab].tolist(), infos[0])
    assert out.next_token_ids[0] == max(range(vocab), key=lambda t: expected[t])
    assert out.next_token_ids[1] not in (0, 9)
    assert out.next_token_ids[2] != int(logits[2, :vocab].argmax())


def test_inference_mode_logits_accepted_outside_inference_mode() -> None:
    with torch.inference_mode():
        logits = torch.randn(2, 128)
    infos = [info(temperature=0.0, presence_penalty=1.0, output=[3]), info(seed=1)]
    out = Sampler(128, torch.device("cpu")).sample(logits, infos)
    assert all(0 <= t < 128 for t in out.next_token_ids)


def test_min_p_keeps_exactly_tokens_above_fraction_of_max() -> None:
    n = 20000
    row = torch.tensor(SMALL_LOGITS)
    prob = torch.softmax(row, -1)
    sampler = Sampler(len(SMALL_LOGITS), torch.device("cpu"), seed=11)
    for min_p in (0.05, 0.3, 0.6):
        infos = [info(min_p=min_p) for _ in range(n)]
        tokens = set(sampler.sample(row.expand(n, -1), infos).next_token_ids)
        assert tokens == set((prob >= min_p * prob.max()).nonzero().flatten().tolist())


def test_mismatched_logits_rejected() -> None:
    sampler = Sampler(10, torch.device("cpu"))
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(2, 10), [info()])
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(1, 9), [info()])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    vocab, width, n = 49152, 49152, 32
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(n, width, generator=g) * 3
    infos = [
        info(temperature=0.0, logprobs=3, output=[5, 5], presence_penalty=0.5),
        *[info(temperature=0.8, top_p=0.9, seed=i, output=[i]) for i in range(n - 1)],
    ]
    cpu = Sampler(vocab, torch.device("cpu"), seed=0).sample(logits, infos)
    cuda = Sampler(vocab, torch.device("cuda"), seed=0).sample(logits.cuda(), infos)
    assert cuda.next_token_ids[0] == cpu.next_token_ids[0]
    assert cuda.logprobs[0] == pytest.approx(cpu.logprobs[0], abs=1e-4)
    alone = [
        Sampler(vocab, torch.device("cuda")).sample(logits[i : i + 1].cuda(), [infos[i]])
        for i in range(1, n)
    ]
    assert [o.next_token_ids[0] for o in alone] == cuda.next_token_ids[1:]
    agree = sum(a == b for a, b in zip(cuda.next_token_ids, cpu.next_token_ids, strict=True))
    assert agree >= n - 2
