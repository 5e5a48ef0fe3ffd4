"""Streaming detokenization: token ids in, safe text deltas out."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from minisgl.tokenizer.stop import StopMatcher

REPLACEMENT_CHAR = "\ufffd"
MAX_HELD_TOKENS = 32
SETTLE_TOKENS = 4
MAX_SPLIT_TRIES = 8
MAX_WINDOW_TOKENS = 64


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Only a small window of ids is decoded per call::

        ids:  [ ... emitted long ago ... | prefix ... read | new ids ... ]
                                          ^prefix_offset   ^read_offset

    ``decode(ids[prefix:read])`` is text already emitted; the delta is what
    ``decode(ids[prefix:])`` adds after it. Decoding from a few tokens back (instead of
    from ``read``) keeps decoders that treat the first token specially (leading-space
    stripping) consistent with decoding the whole sequence. While the decoded tail ends
    with U+FFFD (an incomplete UTF-8 sequence split across byte-level tokens) the new ids
    are held back; if more than ``MAX_HELD_TOKENS`` pile up behind genuinely invalid bytes,
    the window is split at a point where decoding is settled, which keeps the work per
    token bounded.

    Invariant (no stop strings): ``"".join(deltas) + flush()`` equals
    ``tok.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``.
    It holds for any ids with byte-level BPE tokenizers, and for valid text with
    SentencePiece-style byte-fallback tokenizers (whose decoder turns a whole run of byte
    tokens into U+FFFD once any byte in it is invalid, which no stream can anticipate).
    With stop strings, the emitted text is that decode cut right before the first stop
    string, and no emitted delta ever contains part of a possible stop string.
    """

    def __init__(
        self,
        tok: PreTrainedTokenizerBase,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tok
        self._skip_special_tokens = skip_special_tokens
        self._stops = StopMatcher(stop)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._token_has_text: dict[int, bool] = {}
        self.stopped = False
        self.matched_stop: str | None = None
        self.text = ""

    @property
    def num_tokens(self) -> int:
        """How many token ids have been fed so far."""
        return len(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new output ids; return the newly safe text ('' once stopped)."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        return self._emit(self._advance())

    def flush(self) -> str:
        """Release all held-back text at the end of generation ('' once stopped)."""
        if self.stopped:
            return ""
        tail = self._advance(final=True)
        text = self._emit(tail)
        if self.stopped:
            return text
        rest = self._stops.flush()
        self.text += rest
        return text + rest

    def _emit(self, text: str) -> str:
        if not text:
            return ""
        safe, stop = self._stops.feed(text)
        if stop is not None:
            self.stopped = True
            self.matched_stop = stop
        self.text += safe
        return safe

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._decode_ids(self._ids[start:end])

    def _decode_ids(self, ids: list[int]) -> str:
        return self._tok.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _advance(self, final: bool = False) -> str:
        """Decode the window and move the offsets past the text that is safe to emit."""
        num_ids = len(self._ids)
        if self._read_offset == num_ids:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            if num_ids - self._read_offset > MAX_HELD_TOKENS:
                return self._split_settled(prefix_text, full_text)
            return ""
        delta = full_text[len(prefix_text) :]
        self._move_read_offset(num_ids, delta)
        return delta

    def _move_read_offset(self, read_offset: int, delta: str) -> None:
        """Mark ids before ``read_offset`` as emitted; the window then starts at the old one.

        The window start only moves past ids that produced text: a window opening with
        ids that decode to nothing (skipped special tokens) would let decoders that strip
        the first leading space eat a space that belongs to later text.
        """
        if delta or read_offset - self._prefix_offset > MAX_WINDOW_TOKENS:
            self._prefix_offset = self._read_offset
        self._read_offset = read_offset

    def _split_settled(self, prefix_text: str, full_text: str) -> str:
        """Emit up to the latest split point whose text can no longer change.

        A split at ``k`` is settled when at least ``SETTLE_TOKENS`` ids after it decode to
        non-empty text (so at least that many bytes follow it, and a UTF-8 character spans
        at most four bytes: later ids cannot reinterpret bytes before ``k``) and decoding
        both sides apart equals decoding them together.
        """
        following = 0
        tried = 0
        for k in range(len(self._ids) - 1, self._read_offset, -1):
            following += self._has_text(self._ids[k])
            if following < SETTLE_TOKENS:
                continue
            head = self._decode(self._prefix_offset, k)
            if head.startswith(prefix_text) and full_text == head + self._decode(k):
                delta = head[len(prefix_text) :]
                self._move_read_offset(k, delta)
                return delta
            tried += 1
            if tried == MAX_SPLIT_TRIES:
                break
        return ""

    def _has_text(self, token_id: int) -> bool:
        known = self._token_has_text.get(token_id)
        if known is None:
            known = self._token_has_text[token_id] = bool(self._decode_ids([token_id]))
        return known
