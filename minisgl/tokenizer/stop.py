"""Matching stop strings in streamed text without ever emitting part of one."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Filters a text stream, cutting it before the first stop string.

    Text that could still turn out to be the start of a stop string is held back until it is
    disambiguated, so no emitted piece ever contains any part of a stop string. The match
    that wins is the one that completes first in the stream (smallest end offset; the longer
    stop on a tie), which makes the result independent of how the stream is chunked.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Return ``(text safe to emit, matched stop string or None)`` after adding ``text``.

        On a match, the safe text ends right before the stop string and the rest is dropped.
        """
        if not self.stops:
            return text, None
        buf = self._pending + text
        stop, start = self._first_match(buf)
        if stop is not None:
            self._pending = ""
            return buf[:start], stop
        keep = self._possible_prefix_len(buf)
        cut = len(buf) - keep
        self._pending = buf[cut:]
        return buf[:cut], None

    def flush(self) -> str:
        """Release the held-back text at the end of the stream."""
        text, self._pending = self._pending, ""
        return text

    def _first_match(self, buf: str) -> tuple[str | None, int]:
        best: str | None = None
        best_key = (len(buf) + 1, 0)
        for stop in self.stops:
            start = buf.find(stop)
            if start >= 0:
                key = (start + len(stop), -len(stop))
                if key < best_key:
                    best, best_key = stop, key
        if best is None:
            return None, -1
        return best, best_key[0] - len(best)

    def _possible_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest
