"""Streaming detokenization and stop strings, checked against whole-sequence decoding."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.tokenizer import IncrementalDetokenizer, StopMatcher, load_tokenizer

PIECES = [
    "Hello",
    " world",
    ", ",
    "世界",
    "你好吗？",
    "日本語のテキスト",
    "🤖",
    "👍🏽",
    "👨‍👩‍👧‍👦",
    "🇫🇷",
    " naïve café",
    "Привет",
    "مرحبا",
    "\n\n",
    "  ",
    "e\u0301",
    "∑x²",
    "<tag>",
    "1234567",
]


@pytest.fixture(scope="session")
def tok():
    from minisgl.models.loader import resolve_model_path

    return load_tokenizer(resolve_model_path(None))


def stream(
    detok: IncrementalDetokenizer, ids: list[int], rng: random.Random, max_chunk: int = 1
) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        deltas.append(detok.add(ids[i : i + n]))
        i += n
    return deltas


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 25)))


def test_multibyte_chars_are_split_across_tokens(tok):
    for char in ["🤖", "😀", "世"]:
        ids = tok.encode(char, add_special_tokens=False)
        assert len(ids) > 1
        detok = IncrementalDetokenizer(tok)
        assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
        assert detok.add(ids[-1:]) == char


@pytest.mark.parametrize("max_chunk", [1, 3])
def test_random_valid_text_streams(tok, max_chunk):
    rng = random.Random(max_chunk)
    for _ in range(300):
        text = random_text(rng)
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok)
        deltas = stream(detok, ids, rng, max_chunk)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == text == tok.decode(ids, skip_special_tokens=True)
        assert detok.flush() == ""
        assert detok.text == text


def test_random_id_streams_match_full_decode(tok):
    rng = random.Random(0)
    vocab = len(tok)
    for trial in range(600):
        n = rng.randint(0, 80)
        if trial % 3 == 0:
            ids = [rng.randrange(vocab) for _ in range(n)]
        elif trial % 3 == 1:
            ids = [rng.randrange(0, 300) for _ in range(n)]
        else:
            ids = [
                rng.randrange(vocab) if rng.random() < 0.3 else rng.randrange(400) for _ in range(n)
            ]
        detok = IncrementalDetokenizer(tok)
        joined = "".join(stream(detok, ids, rng, max_chunk=4)) + detok.flush()
        assert joined == detok.text == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens(tok):
    ids = tok.encode("Paris.", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "Paris."
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "Paris.<|im_end|>"
    detok = IncrementalDetokenizer(tok, stop=["<|im_end|>"], skip_special_tokens=False)
    assert "".join(detok.add([i]) for i in ids) == "Paris."
    assert detok.matched_stop == "<|im_end|>"


def test_stop_spanning_tokens_is_never_streamed(tok):
    stop = "<<END>>"
    text = "The answer is 42.<<END>> ignored tail"
    ids = tok.encode(text, add_special_tokens=False)
    expected = "The answer is 42."
    assert len(tok.encode(stop, add_special_tokens=False)) > 1
    detok = IncrementalDetokenizer(tok, stop=[stop])
    deltas = []
    for i in ids:
        deltas.append(detok.add([i]))
        assert expected.startswith(detok.text)
        if detok.stopped:
            break
    assert "".join(deltas) == detok.text == expected
    assert detok.stopped and detok.matched_stop == stop
    assert detok.add(ids) == ""
    assert detok.flush() == ""
    assert detok.text == expected


def test_partial_stop_is_held_then_released(tok):
    text = "It was the END of the story"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["ENDING", "story!"])
    for i in ids:
        detok.add([i])
        assert text.startswith(detok.text)
        assert "END" not in detok.text or "END " in detok.text
    assert detok.text == "It was the END of the "
    assert detok.flush() == "story"
    assert detok.text == text and not detok.stopped and detok.matched_stop is None


def test_immediate_stop_gives_empty_text(tok):
    ids = tok.encode("STOP right here", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    deltas = [detok.add([i]) for i in ids]
    assert deltas == [""] * len(ids)
    assert detok.flush() == ""
    assert detok.text == "" and detok.stopped and detok.matched_stop == "STOP"


@pytest.mark.parametrize("max_chunk", [1, 2, 1000])
def test_earliest_stop_wins(tok, max_chunk):
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["delta", "gamma", "beta"])
    text = "".join(stream(detok, ids, random.Random(1), max_chunk))
    assert text == "alpha " and detok.matched_stop == "beta"


def test_stop_found_at_flush(tok):
    ids = tok.encode("count: 1 2 3", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["3"])
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == detok.text == "count: 1 2 "
    assert detok.matched_stop == "3"


def test_random_streams_with_stop(tok):
    rng = random.Random(7)
    for _ in range(300):
        text = random_text(rng) + random_text(rng)
        if not text:
            continue
        start = rng.randrange(len(text))
        stop = text[start : start + rng.randint(1, 6)]
        expected = text[: text.find(stop)]
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, stop=[stop])
        for delta in stream(detok, ids, rng, max_chunk=3):
            assert "\ufffd" not in delta
            assert expected.startswith(detok.text)
        assert detok.stopped and detok.matched_stop == stop
        assert detok.flush() == ""
        assert detok.text == expected


@pytest.fixture(scope="module")
def sentencepiece_tok():
    """A Llama-2 style tokenizer: "▁" word pieces, byte fallback, first space stripped."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizer
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    trainer_tok.train_from_iterator(["Hello world, this is a test of naïve café"] * 20, trainer)
    vocab = trainer_tok.get_vocab()
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) for m in json.loads(trainer_tok.to_str())["model"]["merges"]]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizer
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_sentencepiece_style_streams(sentencepiece_tok, skip_special_tokens):
    tok = sentencepiece_tok
    assert "<0xF0>" in tok.convert_ids_to_tokens(tok.encode("🤖", add_special_tokens=False))
    assert tok.convert_ids_to_tokens(tok.encode("x", add_special_tokens=False))[0][0] == "▁"
    assert tok.decode(tok.encode("x", add_special_tokens=False)) == "x"
    specials = tok.convert_tokens_to_ids(["<unk>", "<s>", "</s>"])
    rng = random.Random(11)
    words = [" Hello", " world", " this", " is", " a", " test", " naïve", "café", "🤖", "世界"]
    for trial in range(400):
        text = "".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
        ids = []
        for i in tok.encode(text, add_special_tokens=False):
            if trial % 2 and rng.random() < 0.2:
                ids.append(rng.choice(specials))
            ids.append(i)
        reference = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if "\ufffd" in reference:
            continue
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        deltas = stream(detok, ids, rng, max_chunk=3)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) + detok.flush() == reference


class CountingTokenizer:
    """Wraps a tokenizer and counts how many ids it is asked to decode."""

    def __init__(self, tok):
        self.tok = tok
        self.decoded_ids = 0

    def decode(self, ids, **kwargs):
        self.decoded_ids += len(ids)
        return self.tok.decode(ids, **kwargs)


def test_work_per_token_is_bounded(tok):
    text = "".join(PIECES) * 40
    ids = tok.encode(text, add_special_tokens=False)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, stop=["never appears"])
    joined = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert joined == text
    assert counting.decoded_ids <= 12 * len(ids)


def invalid_byte_pools(tok) -> list[list[int]]:
    """Token pools whose random streams keep ending in U+FFFD (invalid UTF-8)."""
    byte_tokens = [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd"]
    lead = tok.encode("世", add_special_tokens=False)[0]
    continuation = [t for t in byte_tokens if "\ufffd" not in tok.decode([lead, t])]
    assert len(continuation) >= 32
    truncated = [tok.encode(c, add_special_tokens=False)[:2] for c in "😀🤖"]
    assert tok.decode(truncated[0] * 3) == "\ufffd" * 3
    emoji_pieces = truncated[0] + truncated[1]
    specials = sorted(tok.added_tokens_decoder)
    assert specials and all(tok.decode([i], skip_special_tokens=True) == "" for i in specials)
    return [
        continuation,
        continuation + specials,
        byte_tokens,
        emoji_pieces,
        emoji_pieces + specials,
    ]


def test_invalid_byte_streams_match_full_decode(tok):
    rng = random.Random(5)
    pools = invalid_byte_pools(tok)
    for trial in range(200):
        ids = [rng.choice(pools[trial % len(pools)]) for _ in range(rng.randint(30, 150))]
        detok = IncrementalDetokenizer(tok)
        joined = "".join(stream(detok, ids, rng, max_chunk=2)) + detok.flush()
        assert joined == tok.decode(ids, skip_special_tokens=True)


def test_invalid_byte_runs_keep_window_small(tok):
    rng = random.Random(3)
    streams = [[rng.choice(pool) for _ in range(2000)] for pool in invalid_byte_pools(tok)]
    for ids in streams:
        counting = CountingTokenizer(tok)
        detok = IncrementalDetokenizer(counting)
        joined = "".join(detok.add([i]) for i in ids) + detok.flush()
        assert joined == tok.decode(ids, skip_special_tokens=True)
        assert counting.decoded_ids <= 100 * len(ids)


def first_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if stop and text[:end].endswith(stop):
                return text[: end - len(stop)], stop
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=30),
    stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_stop_matcher_any_chunking(text, stops, cuts):
    expected = first_stop(text, stops)
    matcher = StopMatcher(stops)
    bounds = [0, *sorted(cuts), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    emitted, matched = "", None
    for piece in pieces:
        out, matched = matcher.feed(piece)
        emitted += out
        assert expected[0].startswith(emitted)
        if matched is not None:
            break
    if matched is None:
        emitted += matcher.flush()
    assert (emitted, matched) == expected
