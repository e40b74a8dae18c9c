"""Incremental detokenization: streamed pieces concatenate to the full decode, and a character
split over several tokens is never emitted as U+FFFD while more tokens may follow."""

from __future__ import annotations

import pytest
from tpserve.tokenizer.incremental import REPLACEMENT_CHAR, IncrementalDecoder

TEXTS = [
    "Hello, world! The quick brown fox.",
    "今天天气很好，我们去公园散步吧。",
    "Emoji 🙂🚀✨ and math ∑ x² ≤ ∞ — naïve café",
    "日本語：こんにちは、世界。𝕳𝖊𝖑𝖑𝖔 龘 𠀋",
    "mixed 中文 and English\nnew line\tand tab",
]


def stream(tokenizer, ids, step=1, skip_special_tokens=True):
    dec = IncrementalDecoder(tokenizer, skip_special_tokens)
    pieces = []
    for i in range(0, len(ids), step):
        chunk = ids[i : i + step]
        pieces.append(dec.add(chunk, final=i + step >= len(ids)))
    return pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("which", ["tiny_tokenizer", "qwen3_tokenizer"])
def test_stream_equals_full_decode(request, which, text):
    tok = request.getfixturevalue(which)
    ids = tok.encode(text, add_special_tokens=False)
    for step in (1, 2, 3):
        pieces = stream(tok, ids, step)
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_split_character_is_held_back(tiny_tokenizer):
    # The tiny tokenizer has no merges for these characters: each is 3-4 byte tokens.
    ids = tiny_tokenizer.encode("龘🙂", add_special_tokens=False)
    single = [tiny_tokenizer.decode([i]) for i in ids]
    assert any(REPLACEMENT_CHAR in s for s in single), "test needs a character split over tokens"
    pieces = stream(tiny_tokenizer, ids)
    assert [p for p in pieces if p] == ["龘", "🙂"]


def test_qwen3_split_character(qwen3_tokenizer):
    text = "龘𠀋𝕳"
    ids = qwen3_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 3  # at least one character spans several tokens
    pieces = stream(qwen3_tokenizer, ids)
    assert "".join(pieces) == text
    assert all(REPLACEMENT_CHAR not in p for p in pieces)


def test_incomplete_tail_flushed_at_finish(tiny_tokenizer):
    ids = tiny_tokenizer.encode("ab🙂", add_special_tokens=False)[:-1]  # emoji cut short
    dec = IncrementalDecoder(tiny_tokenizer)
    held = "".join(dec.add([i]) for i in ids)
    assert held == "ab"
    tail = dec.add([], final=True)
    assert held + tail == tiny_tokenizer.decode(ids)
    assert tail.endswith(REPLACEMENT_CHAR)


def test_special_tokens_skipped_or_kept(tiny_tokenizer):
    ids = tiny_tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert "".join(stream(tiny_tokenizer, ids)) == "user\nhi"
    assert "".join(stream(tiny_tokenizer, ids, skip_special_tokens=False)) == "<|im_start|>user\nhi<|im_end|>"


def test_empty_final_add_is_harmless(tiny_tokenizer):
    dec = IncrementalDecoder(tiny_tokenizer)
    assert dec.add([], final=True) == ""
    assert dec.add(tiny_tokenizer.encode("x", add_special_tokens=False)) == "x"
