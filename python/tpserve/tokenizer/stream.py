"""Streamed text out of token ids: incremental detokenization, then stop strings.

``IncrementalDecoder`` uses the standard prefix-offset / read-offset technique: decode a small
window of recent tokens without and with the new tokens, and emit the difference. A window
(rather than each token alone) keeps tokenizer-specific spacing right, and a window that ends in
an incomplete UTF-8 character (decoded as U+FFFD) is held back until later tokens complete it.
Everything emitted concatenates to ``tokenizer.decode(all_ids)``.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Protocol

from tpserve.parsers.partial import partial_suffix_len

REPLACEMENT_CHAR = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's piece for one raw byte


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte in a vocabulary entry."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """A token's own bytes, given its decoded ``text``: the text's UTF-8, unless the token holds
    part of a multi-byte character (decoded as U+FFFD); then the bytes its vocabulary entry stands
    for (byte-level BPE, or a SentencePiece byte-fallback piece such as ``<0xE4>``)."""
    if REPLACEMENT_CHAR not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if (match := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(match.group(1), 16)])
        alphabet = _byte_level_alphabet()
        if piece and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
    return text.encode("utf-8")


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = 0  # tokens before this have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Append tokens and return the new complete text (possibly ""). With ``final`` the held-back
        tail is flushed even if it ends with an incomplete character: no later token can complete it."""
        self.token_ids.extend(new_ids)
        if self._read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        complete = not full_text.endswith(REPLACEMENT_CHAR)
        if len(full_text) > len(prefix_text) and (complete or final):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            return full_text[len(prefix_text) :]
        return ""


class StopStringFilter:
    """Feed text chunks, get back the text that is safe to emit: output is trimmed at the first stop
    string, even one spanning several chunks, and a tail that could still grow into one is held back.

    ``stopped`` becomes True once a stop string is complete and ``matched`` is that string;
    everything after it is never emitted, nor the stop string itself (OpenAI semantics) unless
    ``include_stop`` is set.
    """

    def __init__(self, stop: list[str] | None, include_stop: bool = False) -> None:
        self._stop = tuple(s for s in (stop or []) if s)
        self._max_len = max((len(s) for s in self._stop), default=0)
        self.include_stop = include_stop  # the stop string (or the stop token's text) stays in the output
        self._text = ""  # what was received, less the emitted text no match can reach (_forget_emitted)
        self._emitted = 0  # chars of _text already returned
        self._armed_from = 0  # no match may end at or before this (the text of the tokens before min_tokens)
        self.stopped = False
        self.matched: str | None = None

    def feed(self, chunk: str, final: bool = False, armed: bool = True) -> str:
        """Add ``chunk``; return the newly emittable text. ``final`` releases held-back text; ``armed`` False (the
        tokens before ``min_tokens``): no stop string ends in this chunk."""
        if self.stopped:
            return ""
        if not self._stop:
            return chunk
        self._text += chunk
        # Emitted text never holds the start of a stop string (a possible start is held back),
        # and an earlier complete match would have stopped us: a match must end in the new chunk.
        search_from = max(self._emitted, len(self._text) - len(chunk) - (self._max_len - 1))
        if not armed:
            self._armed_from = len(self._text)
        hit = self._first_stop(search_from) if armed else None
        if hit is not None:
            cut, self.matched = hit
            self.stopped = True
            return self._take(cut + len(self.matched) if self.include_stop else cut)
        if final:
            return self._take(len(self._text))
        out = self._take(len(self._text) - partial_suffix_len(self._text[self._emitted :], self._stop))
        self._forget_emitted()
        return out

    def _forget_emitted(self) -> None:
        """Drop the emitted text no match can reach back into (all but its last longest-stop - 1 characters),
        so a long output costs linear time: the whole text kept and re-concatenated took 2.7 s for 100k tokens."""
        drop = self._emitted - (self._max_len - 1)
        if drop > 0:
            self._text = self._text[drop:]
            self._emitted -= drop
            self._armed_from -= drop

    def _first_stop(self, start: int) -> tuple[int, str] | None:
        """(position, stop string) of the match that is complete first (the earliest end: where a stream read
        character by character would stop, however the text is cut into tokens); of those ending together, the
        one that starts first. A stop string that another one starting at the same place extends ("\n" and
        "\n\n" in the one token "\n\n") is complete first, so it is the match: the output ends there."""
        hits = [(i + len(s), i, s) for s in self._stop
                if (i := self._text.find(s, max(start, self._armed_from - len(s) + 1))) >= 0]
        if not hits:
            return None
        _, i, s = min(hits)
        return i, s

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        out = self._text[self._emitted : end]
        self._emitted = end
        return out


class OutputText:
    """One request's output text as its tokens arrive: decoded incrementally, without the text of the stop token
    that ended it (unless ``include_stop``), cut at its first stop string that ends after the first ``min_tokens``
    tokens (vLLM's rule: until then no stop string counts)."""

    def __init__(self, tokenizer: Decoder, stop: list[str] | None, include_stop: bool = False,
                 min_tokens: int = 0, skip_special_tokens: bool = True) -> None:
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self.stop = StopStringFilter(stop, include_stop)
        self._min_tokens = min_tokens
        self._tokens = 0
        self.kept = 0  # of the last ``add``'s tokens, those the output keeps: up to the one that completed a stop string

    def add(self, token_ids: list[int], matched_stop: int | str | None, final: bool) -> str:
        """The new text of ``token_ids``; ``matched_stop``: the stop token (an int) that ended the request, if one did.
        Several tokens (speculative decoding's accepted drafts) are read one at a time, as decoding's come: a stop
        string ends the output at the token that completed it (``kept``)."""
        self.kept = len(token_ids)
        if len(token_ids) > 1 and self.stop._stop:
            texts = []
            for count, token in enumerate(token_ids, start=1):
                last = count == len(token_ids)
                texts.append(self._add([token], matched_stop if last else None, final and last))
                if self.stop.stopped:
                    self.kept = count
                    break
            return "".join(texts)
        return self._add(token_ids, matched_stop, final)

    def _add(self, token_ids: list[int], matched_stop: int | str | None, final: bool) -> str:
        self._tokens += len(token_ids)
        if isinstance(matched_stop, int) and not self.stop.include_stop:
            token_ids = token_ids[:-1]  # an EOS shown by skip_special_tokens false too, as vLLM leaves it out
        text = self._decoder.add(token_ids, final=final)
        return self.stop.feed(text, final=final, armed=self._tokens > self._min_tokens)
