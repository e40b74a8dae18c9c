"""Incremental detokenization that is safe for streaming.

The standard prefix-offset / read-offset technique: decode a small window of recent tokens twice,
without and with the new tokens, and emit the difference. Decoding a window (rather than each
token alone) keeps tokenizer-specific spacing right, and a window that ends in an incomplete
UTF-8 character (decoded as U+FFFD) is held back until later tokens complete it.

The concatenation of everything emitted equals ``tokenizer.decode(all_ids)``.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


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
        """Append tokens and return the new complete text (possibly "").

        With ``final`` the held-back tail is flushed as is, even if it ends with an incomplete
        character: no later token can complete it.
        """
        self.token_ids.extend(new_ids)
        if self._read_offset == len(self.token_ids):
            return ""
        window = self.token_ids[self._prefix_offset :]
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(window)
        complete = not full_text.endswith(REPLACEMENT_CHAR)
        if len(full_text) > len(prefix_text) and (complete or final):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            return full_text[len(prefix_text) :]
        return ""
