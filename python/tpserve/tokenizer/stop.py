"""Stop strings over streamed text: trim the output at the first stop string, even when it
spans several chunks, and hold back any tail that could still grow into one."""

from __future__ import annotations

from tpserve.parsers.partial import partial_suffix_len


class StopStringFilter:
    """Feed text chunks, get back the text that is safe to emit.

    ``stopped`` becomes True once a stop string is complete and ``matched`` is that string;
    everything after it is never emitted, nor the stop string itself (OpenAI semantics) unless
    ``include_stop`` is set.
    """

    def __init__(self, stop: list[str] | None, include_stop: bool = False) -> None:
        self._stop = tuple(s for s in (stop or []) if s)
        self._max_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop
        self._text = ""  # everything received
        self._emitted = 0  # chars of _text already returned
        self.stopped = False
        self.matched: str | None = None

    def feed(self, chunk: str, final: bool = False) -> str:
        """Add ``chunk``; return the newly emittable text. ``final`` releases held-back text."""
        if self.stopped:
            return ""
        self._text += chunk
        if not self._stop:
            return self._take(len(self._text))
        # Emitted text never holds the start of a stop string (a possible start is held back),
        # and an earlier complete match would have stopped us: a match must end in the new chunk.
        search_from = max(self._emitted, len(self._text) - len(chunk) - (self._max_len - 1))
        hit = self._first_stop(search_from)
        if hit is not None:
            cut, self.matched = hit
            self.stopped = True
            return self._take(cut + len(self.matched) if self._include_stop else cut)
        if final:
            return self._take(len(self._text))
        return self._take(len(self._text) - partial_suffix_len(self._text[self._emitted:], self._stop))

    def _first_stop(self, start: int) -> tuple[int, str] | None:
        """(position, stop string) of the earliest match; the longest one at a shared position."""
        hits = [(i, -len(s), s) for s in self._stop if (i := self._text.find(s, start)) >= 0]
        if not hits:
            return None
        i, _, s = min(hits)
        return i, s

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        out = self._text[self._emitted : end]
        self._emitted = end
        return out
