"""Streamed text: incremental detokenization (streamed pieces concatenate to the full decode, and a
character split over several tokens is never emitted as U+FFFD while more tokens may follow), and
stop strings over streamed text."""

from __future__ import annotations

import pytest
from tpserve.tokenizer.stream import REPLACEMENT_CHAR, IncrementalDecoder, StopStringFilter

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


def run(stop, chunks, final_at_end=False):
    f = StopStringFilter(stop)
    out = [f.feed(c, final=final_at_end and i == len(chunks) - 1) for i, c in enumerate(chunks)]
    return out, f.stopped


def test_no_stop_strings_pass_through():
    assert run(None, ["a", "bc"]) == (["a", "bc"], False)
    assert run([], ["a"]) == (["a"], False)


def test_stop_inside_one_chunk():
    out, stopped = run(["END"], ["hello END world"])
    assert out == ["hello "] and stopped


def test_stop_spanning_chunks_is_trimmed():
    out, stopped = run(["STOP"], ["abc S", "T", "O", "P tail"])
    assert "".join(out) == "abc " and stopped
    # nothing that could be the start of the stop string was emitted early
    assert out[0] == "abc "


def test_partial_match_released_when_it_diverges():
    out, stopped = run(["STOP"], ["abc ST", "ATE"])
    assert out == ["abc ", "STATE"] and not stopped


def test_partial_match_released_at_finish():
    out, stopped = run(["STOP"], ["abc ST"], final_at_end=True)
    assert out == ["abc ST"] and not stopped


def test_earliest_of_several_stops_wins():
    out, stopped = run(["world", "lo w"], ["hel", "lo world"])
    assert "".join(out) == "hel" and stopped


def test_stop_at_the_very_start():
    out, stopped = run(["\n\n"], ["\n", "\nmore"])
    assert "".join(out) == "" and stopped


@pytest.mark.parametrize("stops", [["\n"], ["\n", "\n\n"], ["\n", "\nUser:"], ["\nUser:", "\n"]])
def test_a_stop_that_ends_before_min_tokens_never_counts(stops):
    """Chunks fed unarmed (the tokens up to min_tokens) can end no stop string, even one held back because it
    might grow into a longer stop string (with two stop strings the held-back "\n" matched once armed)."""
    f = StopStringFilter(stops)
    out = [f.feed(c, armed=i >= 3) for i, c in enumerate("Hi\nthere\nmore")]
    assert "".join(out) == "Hi\nthere" and f.stopped and f.matched == "\n"
    f = StopStringFilter(["ab"])  # one that starts before the boundary and ends after it counts (vLLM's rule)
    assert f.feed("xa", armed=False) + f.feed("b!") == "x" and f.stopped


def test_nothing_after_stop():
    f = StopStringFilter(["x"])
    assert f.feed("axb") == "a"
    assert f.feed("more") == ""
    assert f.feed("", final=True) == ""


@pytest.mark.parametrize("split", range(1, 12))
def test_every_split_point(split):
    text = "say 你好 then 停止 now"
    stop = ["停止"]
    out, stopped = run(stop, [text[:split], text[split:]])
    assert "".join(out) == "say 你好 then " and stopped


def test_overlapping_prefixes():
    out, stopped = run(["aab"], ["a", "a", "a", "b", "c"])
    assert "".join(out) == "a" and stopped


@pytest.mark.parametrize("stops", [["\n", "\n\n"], ["\n\n", "\n"]])
@pytest.mark.parametrize("chunks", [["x\n\n"], ["x\n", "\n"], ["x", "\n", "\n"]])
def test_stop_complete_first_wins_however_the_text_is_cut(stops, chunks):
    """"\n" and "\n\n" start together in Qwen's one token "\n\n": "\n" is complete first, so it is the match (the
    longest at the shared start was taken: include_stop_str_in_output kept "\n\n", matched_stop was "\n\n", and
    the answer depended on whether the model wrote "\n\n" as one token or two)."""
    f = StopStringFilter(stops, include_stop=True)
    assert "".join(f.feed(c) for c in chunks) == "x\n" and f.matched == "\n"


@pytest.mark.parametrize("chunks", [["abc"], ["ab", "c"], ["a", "b", "c"]])
def test_a_later_starting_stop_that_ends_first_wins(chunks):
    """"b" is complete before "abc" is: the output stops there in any chunking (with "abc" in one token the
    earlier start "abc" was taken, so the text depended on the tokenization)."""
    f = StopStringFilter(["abc", "b"])
    assert "".join(f.feed(c) for c in chunks) == "a" and f.matched == "b"


def test_long_streams_keep_only_what_a_match_can_reach():
    """Random texts fed in random chunks give the text cut where the first stop completes, while the filter keeps
    no more than the unsent tail and the longest stop's reach back (linear time on long outputs)."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc\n") for _ in range(rng.randint(0, 200)))
        ends = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
        expected = text[: min(ends)[1]] if ends else text
        f, out, pos = StopStringFilter(stops), [], 0
        while pos < len(text) and not f.stopped:
            step = rng.randint(1, 7)
            out.append(f.feed(text[pos : pos + step]))
            pos += step
        out.append(f.feed("", final=True))
        assert "".join(out) == expected, (stops, text)
    f = StopStringFilter(["STOP"])
    for _ in range(10_000):
        f.feed("abcdefgh")
    assert len(f._text) < 16
