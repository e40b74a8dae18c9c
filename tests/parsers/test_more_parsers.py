"""The parsers vLLM has beyond hermes/qwen3_coder/llama3_json/mistral: pythonic, granite and phi4_mini_json tool
calls, granite reasoning; each on realistic outputs, fed whole and in every chunking of 1 to 7 characters (the
streamed pieces, joined, are the whole response's)."""

from __future__ import annotations

import json

import pytest

from tpserve.parsers.chat_output import ChatOutputConfig, ChatOutputParser, create_tool_parser
from tpserve.parsers.reasoning import create_reasoning_parser


def chunkings(text: str) -> list[list[str]]:
    """The text whole, and cut every n characters for n in 1..7 (and again offset by one character)."""
    out = [[text]]
    for n in range(1, 8):
        out.append([text[i:i + n] for i in range(0, len(text), n)])
        if n > 1 and len(text) > 1:
            out.append([text[:1]] + [text[i:i + n] for i in range(1, len(text), n)])
    return out


def run_reasoning(name: str, chunks: list[str]) -> tuple[str, str]:
    parser = create_reasoning_parser(name, None)
    reasoning = content = ""
    for i, chunk in enumerate(chunks + [""]):
        split = parser.feed(chunk, final=i == len(chunks))
        reasoning += split.reasoning
        content += split.content
    return reasoning, content


GRANITE_THINKING = ("Here is my thought process:\nThe user asks for 2+2. Here is a thought: it is 4.\n\n"
                    "Here is my response:\n2 + 2 = 4. Here is my response: again, inside the answer.")


@pytest.mark.parametrize("text, expected", [
    (GRANITE_THINKING, ("\nThe user asks for 2+2. Here is a thought: it is 4.\n\n",
                        "\n2 + 2 = 4. Here is my response: again, inside the answer.")),
    # "Here's" (some quantized Granites), either phrase
    ("Here's my thought process: hmm Here's my response: ok", (" hmm ", " ok")),
    ("Here is my thought process:a\nHere's my response:b", ("a\n", "b")),
    # blanks before the first phrase
    ("\n Here is my thought process: x Here is my response: y", (" x ", " y")),
    # no thought process: all content, phrases included
    ("The answer is 4.", ("", "The answer is 4.")),
    ("Here is the answer: 4", ("", "Here is the answer: 4")),
    ("Here is my response: 4", ("", "Here is my response: 4")),
    ("I think. Here is my thought process: x Here is my response: y",
     ("", "I think. Here is my thought process: x Here is my response: y")),
    # cut short before the response: the thoughts stay reasoning (the stream cannot take them back)
    ("Here is my thought process: still thinking, Here is my resp", (" still thinking, Here is my resp", "")),
    ("Here is my thou", ("", "Here is my thou")),  # ends inside the first phrase: content after all
    ("Here is my thought process:", ("", "")),
    ("Here is my thought process: 思考 🤔 Here is my response: 答え ✓", (" 思考 🤔 ", " 答え ✓")),
])
def test_granite_reasoning_in_any_chunking(text, expected):
    for chunks in chunkings(text):
        assert run_reasoning("granite", chunks) == expected, chunks


def test_granite_reasoning_holds_back_only_what_may_be_a_phrase():
    parser = create_reasoning_parser("granite", None)
    split = parser.feed("Here is my")
    assert (split.reasoning, split.content) == ("", "") and not parser.in_block
    split = parser.feed(" thought process: step one. Here")
    assert (split.reasoning, split.content) == (" step one. ", "") and parser.in_block
    split = parser.feed(" we go. Here's my resp")
    assert (split.reasoning, split.content) == ("Here we go. ", "")
    split = parser.feed("onse:")
    assert (split.reasoning, split.content) == ("", "") and parser.in_block  # past the phrase, no content yet
    split = parser.feed(" Done.", final=True)
    assert (split.reasoning, split.content) == ("", " Done.") and not parser.in_block


def test_granite_reasoning_through_the_chat_output_parser():
    """--reasoning-parser granite with a tool parser: the response's content goes on to the tool parser."""
    text = ('Here is my thought process:\nNeed the weather.\nHere is my response:\n<|tool_call|>[{"name": '
            '"get_weather", "arguments": {"city": "Paris"}}]')
    for chunks in chunkings(text):
        parser = ChatOutputParser(ChatOutputConfig(reasoning=True, reasoning_parser="granite", tool_parser="granite"))
        reasoning = content = args = ""
        names = []
        for i, chunk in enumerate(chunks + [""]):
            delta = parser.feed(chunk, final=i == len(chunks))
            reasoning, content = reasoning + delta.reasoning, content + delta.content
            names += [d.name for d in delta.tool_calls if d.name]
            args += "".join(d.arguments for d in delta.tool_calls)
        assert (reasoning, content, names) == ("\nNeed the weather.\n", "", ["get_weather"]), chunks
        assert json.loads(args) == {"city": "Paris"} and parser.finish_reason("stop") == "tool_calls"
