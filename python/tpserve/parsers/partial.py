"""Helpers for finding markers in streamed text without emitting half of one too early."""

from __future__ import annotations


def partial_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers``
    (text that could still grow into a marker and must be held back)."""
    longest = max((len(m) for m in markers), default=0)
    for n in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0
