"""The parsers vLLM has beyond hermes/qwen3_coder/llama3_json/mistral: pythonic, granite and phi4_mini_json tool
calls, granite reasoning; each on realistic outputs, fed whole and in every chunking of 1 to 7 characters (the
streamed pieces, joined, are the whole response's)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tpserve.parsers.chat_output import ChatOutputConfig, ChatOutputParser, create_tool_parser
from tpserve.parsers.reasoning import create_reasoning_parser
from test_parsers import rebuilt_by_the_openai_sdk, run_tools as accumulate


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


def run_tools(parser, chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Content and the calls (name, arguments) rebuilt the way the openai SDK's stream accumulator does (each call's
    id and name first, once: ``test_parsers.run_tools``), equal to the parser's own calls."""
    content, calls = accumulate(parser, chunks)
    assert [c.name for c in parser.calls] == [call["name"] for call in calls]
    assert [c.arguments for c in parser.calls] == [call["arguments"] for call in calls]
    return content, [(call["name"], call["arguments"]) for call in calls]


def check_any_chunking(name: str, text: str, content: str, calls: list[tuple[str, Any]], cut_short: bool = False):
    """Every chunking gives the same content and calls as the whole text (calls' arguments compared as JSON where
    the expected value is not a string)."""
    for chunks in chunkings(text):
        parser = create_tool_parser(name)
        got_content, got_calls = run_tools(parser, chunks)
        rebuilt = [(n, a if isinstance(want, str) else json.loads(a)) for (n, a), (_, want) in zip(got_calls, calls)]
        assert (got_content, rebuilt, len(got_calls)) == (content, calls, len(calls)), chunks
        assert parser.cut_short == cut_short, chunks


# ---- pythonic ----
PYTHONIC = ('[get_weather(city="Paris", unit="celsius"), lookup(id=3, tags=["a]b", "c,d"], '
            "opts={'nested': {'deep': [1, 2.5, -3, None, True]}, 'q': 'say \"hi\", (ok)'})]")


@pytest.mark.parametrize("text, content, calls, cut_short", [
    (PYTHONIC, "", [("get_weather", {"city": "Paris", "unit": "celsius"}),
                    ("lookup", {"id": 3, "tags": ["a]b", "c,d"],
                                "opts": {"nested": {"deep": [1, 2.5, -3, None, True]}, "q": 'say "hi", (ok)'}})], False),
    # text before the list is content; so is text after it; blanks alone after it are dropped
    ("Let me look that up.\n\n[search(query='Paris \\'24 [olympics]')]\n", "Let me look that up.\n\n",
     [("search", {"query": "Paris '24 [olympics]"})], False),
    ("[now()] Then I'll answer.", " Then I'll answer.", [("now", {})], False),
    # unicode, escapes, triple-quoted strings, a trailing comma, blanks between calls
    ('[ translate( text="Grüße, 世界 🌍", to = "ja" ) ,\n  run(code="""print(\'a\')\nx = ")"\n"""), ]', "",
     [("translate", {"text": "Grüße, 世界 🌍", "to": "ja"}), ("run", {"code": "print('a')\nx = \")\"\n"})], False),
    ('[f(s="tab\\there \\u00e9 \\\\ end", e=\'\', d={1: "x", "k": []})]', "",
     [("f", {"s": "tab\there é \\ end", "e": "", "d": {"1": "x", "k": []}})], False),
    # two lists, with words between them
    ("[a(x=1)] and [b(y=2)]", " and ", [("a", {"x": 1}), ("b", {"y": 2})], False),
    # not calls: content, as written
    ("See [1] and [docs](http://x) or arr[i] and [a, b].", "See [1] and [docs](http://x) or arr[i] and [a, b].", [],
     False),
    ("[print(x)]", "[print(x)]", [], False),  # a positional argument, and no literal
    ("[f(a=g(1))] text", "[f(a=g(1))] text", [], False),  # a call as a value
    ("[f(a=x)]", "[f(a=x)]", [], False),  # a name as a value
    ("[f(a=1, a=2)]", "[f(a=1, a=2)]", [], False),  # an argument given twice
    ("[f(**k)]", "[f(**k)]", [], False),
    ("[os.system(cmd='ls')]", "[os.system(cmd='ls')]", [], False),  # not a plain name
    ("[f(a=b'raw')]", "[f(a=b'raw')]", [], False),  # bytes have no JSON form
    ("[f(a=1e999)]", "[f(a=1e999)]", [], False),  # infinity neither
    ("[f(a={1, 2})]", "[f(a={1, 2})]", [], False),  # a set
    ("[f(a=1] oops", "[f(a=1] oops", [], False),  # a bracket closing another's
    ("[f(a=1) and more", "[f(a=1) and more", [], False),  # a call, but no list
    ("[f(a='x\ny')]", "[f(a='x\ny')]", [], False),  # a one-line string over two lines
    # a call inside a list that is not a call list is not a call either
    ("[f(x=[g(y=1)])] done", "[f(x=[g(y=1)])] done", [], False),
    # a later element that is not a call: the calls before it went out, the rest is content
    ("[f(a=1), 3]", ", 3]", [("f", {"a": 1})], False),
    ("[f(a=1), g(b=c)] end", ", g(b=c)] end", [("f", {"a": 1})], False),
    # the output ends inside a call (max_tokens, a stop string): content as written, the finish reason kept
    ('[f(a="unfinished', '[f(a="unfinished', [], True),
    ('[f(a=1), g(b=[1, 2', ', g(b=[1, 2', [("f", {"a": 1})], True),
    ("[f(a=1), g", ", g", [("f", {"a": 1})], True),
    ("Sure [get_wea", "Sure [get_wea", [], False),  # never began a call
    # ... or after a whole call: a call
    ("[f(a=1)", "", [("f", {"a": 1})], False),
    ("[f(a=1), ", "", [("f", {"a": 1})], False),
])
def test_pythonic_calls_in_any_chunking(text, content, calls, cut_short):
    check_any_chunking("pythonic", text, content, calls, cut_short)


def test_pythonic_sends_each_call_once_it_closes():
    parser = create_tool_parser("pythonic")
    assert parser.feed("Checking [get_weather(city=").content == "Checking "  # the list held back, not content
    assert parser.feed('"Paris")').calls == []  # "," or "]" not seen yet: it may still be no list
    out = parser.feed(', lookup(id=')
    assert [(d.name, d.arguments) for d in out.calls] == [("get_weather", ""), (None, '{"city": "Paris"}')]
    out = parser.feed("3)]", final=True)
    assert [(d.index, d.name, d.arguments) for d in out.calls] == [(1, "lookup", ""), (1, None, '{"id": 3}')]
    assert [c.id[:5] for c in parser.calls] == ["call_", "call_"] and parser.calls[0].id != parser.calls[1].id


def test_pythonic_long_arguments_are_read_once():
    """A long argument arriving a character at a time is scanned once (the scanner keeps its place), not again for
    each piece: 200 KB in small pieces stays fast."""
    import time

    value = "x" * 200_000
    text = f'[write(path="a.txt", content="{value}")]'
    parser = create_tool_parser("pythonic")
    start = time.monotonic()
    _, calls = run_tools(parser, [text[i:i + 4] for i in range(0, len(text), 4)])
    assert time.monotonic() - start < 10 and json.loads(calls[0][1])["content"] == value


# ---- granite ----
GRANITE = ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], '
           '"opts": {"unit": "C", "note": "a]b,c{d}"}}}, {"arguments": {"q": "héllo \\"x\\""}, "name": "search"}]')


@pytest.mark.parametrize("text, content, calls, cut_short", [
    (GRANITE, "", [("get_weather", {"city": "Paris", "days": [1, 2], "opts": {"unit": "C", "note": "a]b,c{d}"}}),
                   ("search", {"q": 'héllo "x"'})], False),
    # Granite 3.1's <tool_call>, both tags, or the array alone (the token skipped as a special token)
    (' <tool_call>\n[{"name": "f", "arguments": {}}]', "", [("f", {})], False),
    ('<|tool_call|> <tool_call>[{"name": "f", "arguments": {"a": 1}}]', "", [("f", {"a": 1})], False),
    ('[{"name": "f", "arguments": {"a": "日本"}}]', "", [("f", {"a": "日本"})], False),
    ('<|tool_call|>{"name": "f", "arguments": {"a": 1}}', "", [("f", {"a": 1})], False),  # an object after the tag
    # the arguments as written, not re-serialized
    ('<|tool_call|>[{"name": "f", "arguments": {"a":1,  "b":"\\u00e9"}}]', "", [("f", '{"a":1,  "b":"\\u00e9"}')], False),
    # text after the array is content
    ('<|tool_call|>[{"name": "f", "arguments": {}}] Done.', "Done.", [("f", {})], False),
    # not calls: content, as written
    ("The answer is 4.", "The answer is 4.", [], False),
    ("[1, 2] are numbers", "[1, 2] are numbers", [], False),
    ('[{"answer": 42}]', '[{"answer": 42}]', [], False),
    ('{"name": "f", "arguments": {}}', '{"name": "f", "arguments": {}}', [], False),  # an object without the tag
    ("Let me call <|tool_call|>[]", "Let me call <|tool_call|>[]", [], False),  # text first: content (vLLM's)
    ("<|tool_call|>oops", "<|tool_call|>oops", [], False),
    ("<|tool_ca", "<|tool_ca", [], False),
    # cut short inside a call's arguments
    ('<|tool_call|>[{"name": "f", "arguments": {"a": [1', "", [("f", '{"a": [1')], True),
])
def test_granite_calls_in_any_chunking(text, content, calls, cut_short):
    check_any_chunking("granite", text, content, calls, cut_short)


def test_granite_streams_arguments_as_they_are_written():
    parser = create_tool_parser("granite")
    assert parser.feed('<|tool_call|>[{"name": "get_wea').calls == []
    out = parser.feed('ther", "arguments": {"city": "Pa')
    assert [(d.name, d.arguments) for d in out.calls] == [("get_weather", ""), (None, '{"city": "Pa')]


# ---- phi4_mini_json ----
PHI4 = ('I will check both.functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, [2]]}}, '
        '{"name": "search", "parameters": {"q": "a]b, \\"c\\" 日本"}}]')


@pytest.mark.parametrize("text, content, calls, cut_short", [
    (PHI4, "I will check both.", [("get_weather", {"city": "Paris", "days": [1, [2]]}),
                                  ("search", {"q": 'a]b, "c" 日本'})], False),
    ('functools[{"name": "f", "arguments": {}}]', "", [("f", {})], False),
    ('functools[{"name": "f", "arguments": {"a": 1}}]\nDone.', "Done.", [("f", {"a": 1})], False),
    # not calls: content, as written
    ("I used functools.partial and functools [x].", "I used functools.partial and functools [x].", [], False),
    ("functools[not json]", "functools[not json]", [], False),
    ('functools[{"answer": 1}]', 'functools[{"answer": 1}]', [], False),
    ("Hi functool", "Hi functool", [], False),
    # cut short inside a call
    ('functools[{"name": "f", "arguments": {"a": "cu', "", [("f", '{"a": "cu')], True),
])
def test_phi4_mini_json_calls_in_any_chunking(text, content, calls, cut_short):
    check_any_chunking("phi4_mini_json", text, content, calls, cut_short)


@pytest.mark.parametrize("parser, text", [("pythonic", PYTHONIC), ("granite", GRANITE), ("phi4_mini_json", PHI4)])
def test_streamed_calls_rebuilt_by_the_openai_sdk(parser, text):
    """The deltas, sent in chunks as the server sends them, rebuild the calls in the openai SDK's own stream
    accumulator."""
    message, tool_parser, _ = rebuilt_by_the_openai_sdk(parser, text)
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        (c.id, c.name, json.loads(c.arguments)) for c in tool_parser.calls]
    assert len(message.tool_calls) == 2


def test_new_parsers_finish_as_tool_calls_unless_cut():
    for parser, text in (("pythonic", PYTHONIC), ("granite", GRANITE), ("phi4_mini_json", PHI4)):
        chat = ChatOutputParser(ChatOutputConfig(tool_parser=parser))
        chat.feed(text, final=True)
        assert len(chat.tool_calls) == 2 and chat.finish_reason("stop") == "tool_calls"
        single = ChatOutputParser(ChatOutputConfig(tool_parser=parser, single_call=True))
        single.feed(text, final=True)
        assert len(single.tool_calls) == 1 and single.finish_reason("stop") == "tool_calls"
    chat = ChatOutputParser(ChatOutputConfig(tool_parser="pythonic"))
    chat.feed('[f(a=1), g(b="cut', final=True)
    assert [c.name for c in chat.tool_calls] == ["f"] and chat.finish_reason("stop") == "stop"


def test_detected_from_their_templates():
    from tpserve.parsers.tool_calls import detect_tool_parser

    granite = ("{%- if available_tools %} You are a helpful assistant with access to the following tools. When a tool "
               "is required to answer the user's query, respond only with <|tool_call|> followed by a JSON list of "
               "tools used.{%- endif %}")
    assert detect_tool_parser(granite) == "granite"
    phi4 = ('all function calls should be generated in a single JSON list formatted as functools[{"name": '
            '[function name], "arguments": [function arguments as JSON]}, ...]')
    assert detect_tool_parser(phi4) == "phi4_mini_json"
    llama32 = ("{{- 'Respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...), "
               "func_name2(params)] ' }}{%- for t in tools %}")
    assert detect_tool_parser(llama32) == "pythonic"
    llama4 = "- Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]\\nExamples:"
    assert detect_tool_parser(llama4) == "pythonic"
    # the others as before
    assert detect_tool_parser('<tool_call>\n{"name": ...}\n</tool_call>') == "hermes"
    assert detect_tool_parser('{%- if tools %}"parameters"{%- endif %}') == "llama3_json"
    assert detect_tool_parser("{{ '<|user|>' + message['content'] + '<|end|>' }}") is None
