"""Stop strings over streamed text."""

from __future__ import annotations

import pytest
from tpserve.tokenizer.stop import StopStringFilter


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
