"""Reasoning and tool-call parsers on scripted outputs, fed whole and in awkward chunk splits."""

from __future__ import annotations

import json
import random

import pytest

from tpserve.parsers.reasoning import ReasoningParser, prompt_opens_reasoning
from tpserve.parsers.chat_output import create_tool_parser
from tpserve.parsers.tool_calls import ForcedToolCalls


def splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and in random cuts."""
    out = [[text], list(text)]
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


def run_reasoning(chunks: list[str], in_reasoning: bool | None) -> tuple[str, str]:
    parser = ReasoningParser(in_reasoning)
    reasoning = content = ""
    for i, chunk in enumerate(chunks + [""]):
        split = parser.feed(chunk, final=i == len(chunks))
        reasoning += split.reasoning
        content += split.content
    return reasoning, content


@pytest.mark.parametrize(
    "text,in_reasoning,expected",
    [
        ("<think>\nplan a b</think>\n\nThe answer.", None, ("\nplan a b", "The answer.")),
        ("<think>the prompt closed a block</think>", False, ("", "<think>the prompt closed a block</think>")),
        ("plan, opened by the template</think>\n\nDone <b>", True, ("plan, opened by the template", "Done <b>")),
        ("No thinking at all, <think> in the middle stays.", None,
         ("", "No thinking at all, <think> in the middle stays.")),
        ("still thinking when max_tokens hit", True, ("still thinking when max_tokens hit", "")),
        ("<thin", None, ("", "<thin")),  # ends with half a tag: it is content after all
    ],
)
def test_reasoning_split_in_any_chunking(text, in_reasoning, expected):
    for chunks in splits(text):
        assert run_reasoning(chunks, in_reasoning) == expected, chunks


def test_a_constrained_answer_is_reasoning_only_where_it_opens_a_block_the_prompt_did_not_close():
    from tpserve.parsers.chat_output import ChatOutputConfig, ChatOutputParser

    def split(start):
        parser = ChatOutputParser(ChatOutputConfig(reasoning=True, starts_in_reasoning=start, constrained=True))
        delta = parser.feed("<think>r</think>c", final=True)
        return delta.reasoning, delta.content

    assert split(True) == split(None) == ("r", "c")
    assert split(False) == ("", "<think>r</think>c")  # enable_thinking false: all content, constrained or not


def test_start_state_follows_the_prompt():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n") is False  # thinking off
    assert prompt_opens_reasoning("<|im_start|>assistant\n") is None
    assert prompt_opens_reasoning("<｜Assistant｜><think>\n")


def run_tools(parser, chunks: list[str]) -> tuple[str, list[dict]]:
    """Content and the calls rebuilt the way the openai SDK's stream accumulator does."""
    content, calls = "", {}
    for i, chunk in enumerate(chunks + [""]):
        out = parser.feed(chunk, final=i == len(chunks))
        content += out.content
        for delta in out.calls:
            d = delta.to_openai()
            call = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
            if "id" in d:
                assert call["id"] is None and d["function"]["name"], "id and name come first, once"
                call["id"], call["name"] = d["id"], d["function"]["name"]
            else:
                assert call["id"] is not None, "arguments before the call's id"
            call["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], '
    '"opt": {"unit": "C"}}}\n</tool_call>\n<tool_call>\n{"arguments": {"q": "x}y"}, "name": "search"}\n</tool_call>'
)


def test_hermes_calls_in_any_chunking():
    for chunks in splits(HERMES):
        content, calls = run_tools(create_tool_parser("hermes"), chunks)
        assert content == "Let me check.\n"
        assert [c["name"] for c in calls] == ["get_weather", "search"]
        assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": [1, 2], "opt": {"unit": "C"}}
        assert json.loads(calls[1]["arguments"]) == {"q": "x}y"}
        assert all(c["id"].startswith("call_") for c in calls)


def test_hermes_streams_arguments_before_the_call_ends():
    parser = create_tool_parser("hermes")
    out = parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": "lo')
    assert [d.name for d in out.calls] == ["f", None] and out.calls[1].arguments == '{"a": 1, "b": "lo'


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": "{\\"a\\": 1}"}'),
])
def test_arguments_written_as_a_json_string_stream_as_they_parse_whole(parser, text):
    """Some models write the arguments as a JSON string holding the JSON (OpenAI's own layout):
    streamed, they went out as the string literal ('"{\\"a\\": 1}"'), whole as its text."""
    for chunks in splits(text):
        content, calls = run_tools(create_tool_parser(parser), chunks)
        assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [("f", '{"a": 1}')], chunks


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "hello"}\n</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": "hello"}'),
])
def test_arguments_written_as_a_string_that_holds_no_json_stay_json(parser, text):
    """A string of no JSON comes back encoded, as vLLM's parsers do ('"hello"'): its bare text was no JSON."""
    for chunks in splits(text):
        assert [c["arguments"] for c in run_tools(create_tool_parser(parser), chunks)[1]] == ['"hello"'], chunks


@pytest.mark.parametrize("after, content", [("\n\n", ""), ("\nDone.\n\n", "\nDone.\n\n"), ("\n\n<tool", "\n\n<tool")])
def test_hermes_text_after_a_call_is_the_same_in_any_chunking(after, content):
    """Whitespace alone between or after calls is dropped; with text it is kept, however the
    stream is cut (a chunk of whitespace alone was dropped even where text followed it)."""
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>' + after
    for chunks in splits(text):
        got, calls = run_tools(create_tool_parser("hermes"), chunks)
        assert (got, [c["name"] for c in calls]) == (content, ["f"]), chunks


def test_hermes_plain_text_and_broken_calls():
    assert run_tools(create_tool_parser("hermes"), ["Just text, a < b."]) == ("Just text, a < b.", [])
    content, calls = run_tools(create_tool_parser("hermes"), ["<tool_call>\n{not json</tool_call>after"])
    assert calls == [] and content == "<tool_call>\n{not json</tool_call>after"  # as written, its closing tag too
    bad_name = '<tool_call>\n{"name": "get_\\x", "arguments": {"a": 1}}\n</tool_call>'  # an invalid JSON escape
    for chunks in splits(bad_name):  # was a JSONDecodeError out of the parser (a 500, a stream cut off)
        assert run_tools(create_tool_parser("hermes"), chunks) == (bad_name, []), chunks


CALL = '<tool_call>\n{"name": "f", "arguments": '


@pytest.mark.parametrize("parser, text, expected, cut_short", [
    # the arguments as written (not re-serialized), streamed or whole
    ("hermes", CALL + '{"city":"Caf\\u00e9"}}\n</tool_call>', [("f", '{"city":"Caf\\u00e9"}')], False),
    ("llama3_json", '{"name": "f", "parameters": {"a":1}}', [("f", '{"a":1}')], False),
    # a key after the arguments, or junk after the call's object, is not part of them
    ("hermes", CALL + '{"city": "Paris"}, "id": "x1"}\n</tool_call>', [("f", '{"city": "Paris"}')], False),
    ("llama3_json", '{"name": "f", "parameters": {"a": "}"}, "id": 1}', [("f", '{"a": "}"}')], False),
    ("hermes", CALL + '{"city": "Paris"}} oops\n</tool_call>', [("f", '{"city": "Paris"}')], False),
    # the end tag inside an argument string is the argument's
    ("hermes", CALL + '{"a": "</tool_call>"}}\n</tool_call>', [("f", '{"a": "</tool_call>"}')], False),
    # closed by its tag, the arguments unclosed: a call (its arguments as written, as OpenAI's need not parse)
    ("hermes", CALL + '{"city": "Pa\n</tool_call>', [("f", '{"city": "Pa\n')], False),
    ("hermes", CALL + '{"a": \n</tool_call>', [("f", '{"a": \n')], False),
    # cut short (max_tokens, a stop string): the call as far as it was written, whether streamed or not
    ("hermes", CALL + '{"city":', [("f", '{"city":')], True),
    ("hermes", CALL + '{"a": "</tool_call>', [("f", '{"a": "</tool_call>')], True),
    ("llama3_json", '{"name": "f", "parameters": {"a": [1', [("f", '{"a": [1')], True),
])
def test_a_call_reads_the_same_streamed_or_whole(parser, text, expected, cut_short):
    """Streamed arguments cannot be taken back, so the whole response is what the stream said."""
    for chunks in splits(text):
        tool_parser = create_tool_parser(parser)
        content, calls = run_tools(tool_parser, chunks)
        assert (content, [(c["name"], c["arguments"]) for c in calls]) == ("", expected), chunks
        assert tool_parser.cut_short == cut_short


LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "now", "parameters": {}}'


def test_llama3_json_in_any_chunking():
    for chunks in splits(LLAMA):
        content, calls = run_tools(create_tool_parser("llama3_json"), chunks)
        assert content == "" and [c["name"] for c in calls] == ["get_weather", "now"]
        assert json.loads(calls[0]["arguments"]) == {"city": "Rome"} and json.loads(calls[1]["arguments"]) == {}
    assert run_tools(create_tool_parser("llama3_json"), ["Hello ", "there"]) == ("Hello there", [])


def test_llama3_json_streams_arguments_before_the_call_ends():
    parser = create_tool_parser("llama3_json")
    assert parser.feed('<|python_tag|>{"name": "get_wea').calls == []  # the name is not complete yet
    out = parser.feed('ther", "parameters": {"city": "Ro')
    assert [(d.name, d.arguments) for d in out.calls] == [("get_weather", ""), (None, '{"city": "Ro')]
    out = parser.feed('me"}}; {"name": "now", "parameters": {')
    assert [(d.index, d.name, d.arguments) for d in out.calls] == [(0, None, 'me"}'), (1, "now", ""), (1, None, "{")]
    assert [(d.index, d.arguments) for d in parser.feed("}}", final=True).calls] == [(1, "}")]


@pytest.mark.parametrize(
    "text,expected",
    [
        ('{"parameters": {"a": [1, 2]}, "name": "late_name"}', ("", [("late_name", {"a": [1, 2]})])),
        ('{"answer": 42}', ('{"answer": 42}', [])),  # JSON, but not a call: content
        ('{"name": "f", "parameters": {"a": "cut sh', ("", [("f", '{"a": "cut sh')])),  # max_tokens
        ('<|python_tag|>{"name": "f", "parameters": {}} and then words', ("and then words", [("f", {})])),
        ("  <|python", ("  <|python", [])),
    ],
)
def test_llama3_json_odd_outputs(text, expected):
    for chunks in splits(text):
        content, calls = run_tools(create_tool_parser("llama3_json"), chunks)
        rebuilt = []
        for c in calls:
            try:
                rebuilt.append((c["name"], json.loads(c["arguments"])))
            except json.JSONDecodeError:
                rebuilt.append((c["name"], c["arguments"]))
        assert (content, rebuilt) == expected, chunks


CODER = ('I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
         '<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{"unit": "C", "x": [1, 2]}\n</parameter>\n</function>\n'
         '</tool_call>\n<tool_call>\n<function=run>\n<parameter=code>\nprint("a")\nif 1 < 2:\n    pass\n</parameter>\n'
         '</function>\n</tool_call>')
CODER_PARAMS = {"get_weather": {"city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}},
                "run": {"code": {"type": "string"}}}


def test_qwen3_coder_calls_in_any_chunking():
    """Qwen3-Coder's XML calls: each call's id and name as soon as its function opens, then one parameter at a
    time, the arguments the JSON of the values typed by the tool's schema (vLLM's qwen3_coder), in any chunking."""
    for chunks in splits(CODER):
        parser = create_tool_parser("qwen3_coder", CODER_PARAMS)
        content, calls = run_tools(parser, chunks)
        assert content == "I will look.\n" and parser.cut_at is None
        assert [c["name"] for c in calls] == ["get_weather", "run"]
        assert calls[0]["arguments"] == json.dumps({"city": "Paris", "days": 3, "opts": {"unit": "C", "x": [1, 2]}})
        assert json.loads(calls[1]["arguments"]) == {"code": 'print("a")\nif 1 < 2:\n    pass'}
    parser = create_tool_parser("qwen3_coder", CODER_PARAMS)
    out = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=da")
    assert [(d.name, d.arguments) for d in out.calls] == [("get_weather", ""), (None, '{"city": "Paris"')]


@pytest.mark.parametrize("value, schema, expected", [
    ("42", {"type": "integer"}, 42), ("4x", {"type": "integer"}, "4x"), ("3.0", {"type": "number"}, 3),
    ("2.5", {"type": "number"}, 2.5), ("True", {"type": "boolean"}, True), ("no", {"type": "boolean"}, False),
    ("null", {"type": "integer"}, None), ("None", {"type": "object"}, None), ('["a", 1]', {"type": "array"}, ["a", 1]),
    ("{'a': 1}", {"type": "object"}, {"a": 1}), ("(1, 2", {"type": "object"}, "(1, 2"),
    ("007", {"type": "string"}, "007"),
    ("7", None, "7"), ("7", {}, "7"), ("[1]", {"anyOf": []}, "[1]"),
    # a string keeps the text "null" (and an undeclared parameter its text), unless its schema admits null
    ("null", {"type": "string"}, "null"), ("null", None, "null"),
    ("None", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),
    # anyOf (Pydantic's Optional[T]): its first type other than null
    ("5", {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5}, 5),
    ('["a", "b"]', {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]}, ["a", "b"]),
    ("true", {"anyOf": [{"type": "null"}, {"type": "boolean"}]}, True),
    ("some text", {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}, "some text"),
    ("42", {"type": ["integer", "null"]}, 42),
    # a Python repr JSON-encoded by a buggy template: decoded twice
    ('"{\'key\': \'value\', \'n\': 1}"', {"type": "object"}, {"key": "value", "n": 1}),
])
def test_qwen3_coder_values_are_typed_by_the_tool_schema(value, schema, expected):
    """As vLLM's qwen3coder_tool_parser (_convert_param_value)."""
    from tpserve.parsers.qwen3_coder import typed_parameter

    assert typed_parameter(value, schema) == expected


def test_qwen3_coder_values_without_a_json_form_are_sent_as_their_text():
    """A typed value JSON cannot hold (NaN for a number, a Python set or bytes literal) goes out as its text: the
    arguments stay JSON (they were 'NaN', or the parser raised)."""
    schemas = {"f": {"x": {"type": "number"}, "s": {"type": "object"}, "b": {"type": "array"}}}
    text = ("<tool_call>\n<function=f>\n<parameter=x>\nnan\n</parameter>\n<parameter=s>\n{1, 2}\n</parameter>\n"
            "<parameter=b>\nb'raw'\n</parameter>\n</function>\n</tool_call>")
    for chunks in splits(text):
        _, calls = run_tools(create_tool_parser("qwen3_coder", schemas), chunks)
        assert [json.loads(c["arguments"]) for c in calls] == [{"x": "nan", "s": "{1, 2}", "b": "b'raw'"}]


@pytest.mark.parametrize("text, content, calls, cut_short", [
    # the output ends after the function, before the block's end tag: a whole call
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>", "", [("f", {"a": "1"})], False),
    # ... or inside a value: the call as far as it got, its finish reason left as it is
    ("<tool_call>\n<function=f>\n<parameter=a>\nab", "", [("f", {"a": "ab"})], True),
    ("<tool_call>\n<function=f>\n</function>\n</tool_call>\nDone.", "\nDone.", [("f", {})], False),
    # a value closed by the next parameter or the function's end, as vLLM reads it
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\n2\n</function>\n</tool_call>", "",
     [("f", {"a": "1", "b": "2"})], False),
    # a block with no function in it is content, as written; so is plain text with tags in it
    ("Hi <tool_call>\noops\n</tool_call>", "Hi <tool_call>\noops\n</tool_call>", [], False),
    ("Hi <tool_call>\noops", "Hi <tool_call>\noops", [], True),
    ("a <function=f> b", "a <function=f> b", [], False),
])
def test_qwen3_coder_odd_outputs(text, content, calls, cut_short):
    for chunks in splits(text):
        parser = create_tool_parser("qwen3_coder")
        got_content, got_calls = run_tools(parser, chunks)
        assert got_content == content and parser.cut_short == cut_short
        assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls


MISTRAL = ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}, '
           '{"name": "search", "arguments": {"q": "a]b,c"}}]')


def test_mistral_calls_in_any_chunking():
    """Mistral's [TOOL_CALLS] and a JSON array of calls: content before it, each call streamed as it is written,
    ids of 9 letters and digits (Mistral's templates refuse others in the calls sent back)."""
    for chunks in splits(MISTRAL):
        parser = create_tool_parser("mistral")
        content, calls = run_tools(parser, chunks)
        assert content == "Sure." and parser.cut_at is None
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris", "days": [1, 2]}), ("search", {"q": "a]b,c"})]
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    parser = create_tool_parser("mistral")
    out = parser.feed('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1, "b": "lo')
    assert [d.name for d in out.calls] == ["f", None] and out.calls[1].arguments == '{"a": 1, "b": "lo'


@pytest.mark.parametrize("text, content", [
    ("Just text, [TOOL and more", "Just text, [TOOL and more"),  # a partial token held back, then let out
    ("Hi [TOOL_CALLS] not json", "Hi [TOOL_CALLS] not json"),  # no call after the token: content, as written
])
def test_mistral_text_without_calls_is_content(text, content):
    for chunks in splits(text):
        got, calls = run_tools(create_tool_parser("mistral"), chunks)
        assert (got, calls) == (content, [])


MISTRAL_V11 = ('Sure.[TOOL_CALLS]get_weather{"city": "Paris", "days": [1, 2]}'
               '[TOOL_CALLS]search[ARGS]{"q": "a]b,c [TOOL"}')


def test_mistral_v11_calls_in_any_chunking():
    """v11+ Mistral tokenizers write each call as [TOOL_CALLS], its name ([ARGS] after it in some templates) and its
    arguments' JSON (vLLM's mistral parser, >= v11): read as such, not as content, streamed or whole."""
    for chunks in splits(MISTRAL_V11):
        parser = create_tool_parser("mistral")
        content, calls = run_tools(parser, chunks)
        assert content == "Sure." and parser.cut_at is None, chunks
        assert [(c["name"], c["arguments"]) for c in calls] == [
            ("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("search", '{"q": "a]b,c [TOOL"}')], chunks
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    parser = create_tool_parser("mistral")
    assert parser.feed("Hi[TOOL_CALLS]get_wea").calls == []  # the name is not complete yet
    out = parser.feed('ther{"a": 1, "b": "lo')
    assert [(d.name, d.arguments) for d in out.calls] == [("get_weather", ""), (None, '{"a": 1, "b": "lo')]


@pytest.mark.parametrize("text, content, calls, cut_short", [
    # the arguments are the text up to the next [TOOL_CALLS] or the end, as written (vLLM's)
    ('[TOOL_CALLS]f{"a": 1}\n', "", [("f", '{"a": 1}\n')], False),
    ('[TOOL_CALLS] f [ARGS]{"a": [1}[TOOL_CALLS]g{}', "", [("f", '{"a": [1}'), ("g", "{}")], False),
    # cut short inside the arguments, or before them: the finish reason stays
    ('[TOOL_CALLS]f{"a": "cu', "", [("f", '{"a": "cu')], True),
    ("[TOOL_CALLS]get_wea", "[TOOL_CALLS]get_wea", [], True),
    # a stretch with no name and arguments is no call: content, as written
    ("[TOOL_CALLS]f{}[TOOL_CALLS]{}[TOOL_CALLS]g{}", "[TOOL_CALLS]{}", [("f", "{}"), ("g", "{}")], False),
    # the array layout, a space or not after the token
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}]', "", [("f", "{}")], False),
])
def test_mistral_layout_is_told_by_what_follows_the_token(text, content, calls, cut_short):
    for chunks in splits(text):
        parser = create_tool_parser("mistral")
        got, got_calls = run_tools(parser, chunks)
        assert (got, [(c["name"], c["arguments"]) for c in got_calls]) == (content, calls), chunks
        assert parser.cut_short == cut_short, chunks


def test_mistral_v11_calls_finish_as_tool_calls():
    from tpserve.parsers.chat_output import ChatOutputConfig, ChatOutputParser

    for single in (False, True):
        chat = ChatOutputParser(ChatOutputConfig(tool_parser="mistral", single_call=single))
        chat.feed(MISTRAL_V11, final=True)
        assert [c.name for c in chat.tool_calls] == (["get_weather"] if single else ["get_weather", "search"])
        assert chat.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("parser, text", [
    ("llama3_json", '{"name": "f", "parameters": {"x": ' + "[" * 3000),
    ("llama3_json", '{"name": "f", "parameters": {"x": ' + "[" * 3000 + "]" * 3000 + "}}"),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"x": ' + "[" * 3000),
    ("qwen3_coder",
     "<tool_call>\n<function=f>\n<parameter=x>\n" + "[" * 3000 + "\n</parameter>\n</function>\n</tool_call>"),
])
def test_json_nested_past_the_decoders_depth_is_no_parser_error(parser, text):
    """A model's output of brackets nested past json's depth was a RecursionError out of the parser (the request a
    500, a stream cut off); the call goes out as its text, as any JSON that does not parse."""
    for chunks in ([text], [text[i:i + 500] for i in range(0, len(text), 500)]):
        _, calls = run_tools(create_tool_parser(parser, {"f": {"x": {"type": "array"}}}), chunks)
        assert [c["name"] for c in calls] == ["f"]


def test_qwen3_coder_is_detected_from_its_template():
    from tpserve.parsers.tool_calls import detect_tool_parser

    template = ("{%- if tools %}<tools>...</tools> call as <tool_call>\n<function=example_function_name>\n"
                "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>{%- endif %}")
    assert detect_tool_parser(template) == "qwen3_coder"
    assert detect_tool_parser("... <tool_call>\n{\"name\": ...}\n</tool_call> ...") == "hermes"
    assert detect_tool_parser('{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}') == "mistral"
    v11 = "{%- for tool in message.tool_calls %}{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + arguments }}"
    assert detect_tool_parser(v11) == "mistral"


def rebuilt_by_the_openai_sdk(parser: str, text: str):
    """(the final message, the parser, the argument fragments sent): ``text`` fed to parser ``parser`` in chunks of 3
    characters, its deltas sent as the server sends them into the openai SDK's own stream accumulator."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from tpserve.parsers.tool_calls import merge_deltas

    state, fragments = ChatCompletionStreamState(), 0
    tool_parser = create_tool_parser(parser)
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    for i, piece in enumerate(pieces + [""]):
        out = tool_parser.feed(piece, final=i == len(pieces))
        delta: dict = {"role": "assistant"} if i == 0 else {}
        if out.content:
            delta["content"] = out.content
        if out.calls:
            delta["tool_calls"] = [d.to_openai() for d in merge_deltas(out.calls)]
            fragments += sum(1 for d in out.calls if d.id is None)
        finish = "tool_calls" if i == len(pieces) else None
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion().choices[0].message, tool_parser, fragments


@pytest.mark.parametrize("parser,text", [("hermes", HERMES), ("llama3_json", LLAMA), ("qwen3_coder", CODER),
                                         ("mistral", MISTRAL), ("mistral", MISTRAL_V11)])
def test_streamed_calls_rebuilt_by_the_openai_sdk(parser, text):
    """The deltas, sent in chunks as the server sends them, rebuild the calls in the openai SDK's
    own stream accumulator, with the arguments arriving in several fragments."""
    message, tool_parser, fragments = rebuilt_by_the_openai_sdk(parser, text)
    expected = [(c.name, json.loads(c.arguments)) for c in tool_parser.calls]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == expected
    assert [c.id for c in message.tool_calls] == [c.id for c in tool_parser.calls]
    assert fragments > 2 * len(expected), "the arguments came in fragments, not whole"


def test_forced_tool_calls():
    content, calls = run_tools(ForcedToolCalls(), ['[{"name": "a", "parameters": {"x": 1}}, ', '{"name": "b", "parameters": {}}]'])
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [("a", {"x": 1}), ("b", {})]
    content, calls = run_tools(ForcedToolCalls("f"), ['{"x": ', '2}'])
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"x": 2})]
    assert run_tools(ForcedToolCalls("f"), ['{"x": '])[0] == '{"x": '  # cut short: left as text


def test_chat_output_reasoning_then_tool_call():
    from tpserve.parsers.chat_output import ChatOutputConfig, ChatOutputParser

    text = 'weigh options</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    for chunks in splits(text):
        parser = ChatOutputParser(ChatOutputConfig(reasoning=True, starts_in_reasoning=True, tool_parser="hermes"))
        reasoning = content = ""
        args = ""
        for i, chunk in enumerate(chunks + [""]):
            delta = parser.feed(chunk, final=i == len(chunks))
            reasoning += delta.reasoning
            content += delta.content
            args += "".join(d.arguments for d in delta.tool_calls)
        assert (reasoning, content, json.loads(args)) == ("weigh options", "", {"a": 1})
        assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"
    cut = ChatOutputParser(ChatOutputConfig(tool_parser="hermes"))  # a stop string inside the call's arguments
    assert cut.feed('<tool_call>\n{"name": "f", "arguments": {"a": ', final=True).tool_calls
    assert cut.finish_reason("stop") == "stop"


def test_parallel_tool_calls_false_returns_the_first_call_only():
    """parallel_tool_calls false with tool_choice auto: the model wrote two calls, the first is returned (streamed or
    whole); the second was returned too."""
    from tpserve.parsers.chat_output import ChatOutputConfig, ChatOutputParser

    text = ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {"b": 2}}\n</tool_call>')
    for single in (False, True):
        for chunks in splits(text):
            parser = ChatOutputParser(ChatOutputConfig(tool_parser="hermes", single_call=single))
            streamed = [d for i, chunk in enumerate(chunks + [""]) for d in parser.feed(chunk, final=i == len(chunks)).tool_calls]
            names = [d.name for d in streamed if d.name]
            assert names == (["f"] if single else ["f", "g"])
            assert [c.name for c in parser.tool_calls] == names
            assert parser.finish_reason("stop") == "tool_calls"


def test_required_tool_calls_keep_the_tools_own_references():
    """tool_choice "required" nests each tool's parameters in one schema of the calls; a tool whose parameters refer to
    themselves ($defs as Pydantic writes them, or "#" for recursion) keeps its references resolving against its own
    schema, not the calls' root (they failed to compile: "Cannot find field '$defs'")."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from tpserve.parsers.constraints import output_structure

    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"], "$defs": {"P": point}}}},
        {"type": "function", "function": {"name": "tree", "parameters": {
            "type": "object", "properties": {"child": {"$ref": "#"}}, "additionalProperties": False}}},
        {"type": "function", "function": {"name": "plain", "parameters": {"type": "object", "properties": {
            "q": {"type": "string"}}, "required": ["q"]}}},
    ]
    spec = output_structure(None, tools=tools, tool_choice="required").spec
    assert json.loads(spec)["items"]["anyOf"][2]["properties"]["parameters"] == tools[2]["function"]["parameters"]
    # a "$ref" inside a value (const, enum, default, examples) is data, left as it is
    data = {"type": "object", "properties": {"p": {"const": {"$ref": "#/x"}}, "q": {"$ref": "#/$defs/Q"}},
            "$defs": {"Q": {"type": "integer"}}}
    moved = json.loads(output_structure(None, tools=[{"type": "function", "function": {"name": "d", "parameters": data}}],
                                        tool_choice="required").spec)["$defs"]["tool0"]
    assert moved["properties"] == {"p": {"const": {"$ref": "#/x"}}, "q": {"$ref": "#/$defs/tool0/$defs/Q"}}
    grammar = Grammar.from_json_schema(spec, any_whitespace=False)
    for text, ok in [
        ('[{"name": "f", "parameters": {"p": {"x": 3}}}]', True),
        ('[{"name": "f", "parameters": {"p": {"x": "3"}}}]', False),
        ('[{"name": "tree", "parameters": {"child": {"child": {}}}}]', True),
        ('[{"name": "tree", "parameters": {"child": {"leaf": 1}}}]', False),
        ('[{"name": "plain", "parameters": {"q": "a"}}, {"name": "f", "parameters": {"p": {"x": 1}}}]', True),
    ]:
        assert accepts(grammar, text) == ok, text


def test_constraints():
    from tpserve.parsers.constraints import FieldError, output_structure
    from tpserve.sampling_params import StructuredOutput

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    assert output_structure(None, tools=tools, tool_choice="auto") is None
    required = output_structure(None, tools=tools, tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(required.spec)
    assert schema["maxItems"] == 1 and [a["properties"]["name"]["const"] for a in schema["items"]["anyOf"]] == ["f", "g"]
    named = output_structure(None, tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
    assert json.loads(named.spec) == {"type": "object"}
    assert output_structure({"type": "json_object"}).kind == "json_object"
    assert output_structure({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}).spec == '{"type": "integer"}'
    assert output_structure(None, regex="[ab]+").kind == "regex"
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    assert output_structure(tag) == StructuredOutput("structural_tag", json.dumps(tag))
    vllm = {"structured_outputs": {"structural_tag": json.dumps(tag)}}
    assert output_structure(None, vllm_specs=vllm) == StructuredOutput("structural_tag", json.dumps(tag))
    for bad, param in [
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(response_format={"type": "json_object"}, regex="a"), "regex"),
        (dict(response_format=None, tools=tools, tool_choice={"type": "function", "function": {"name": "h"}}), "tool_choice"),
        (dict(response_format=None, tool_choice="required"), "tool_choice"),
        (dict(response_format=None, tools=[{"type": "retrieval"}], tool_choice="required"), "tools"),
    ]:
        with pytest.raises(FieldError) as e:
            output_structure(**bad)
        assert e.value.param == param


def test_single_call_finish_ignores_a_dropped_calls_unclosed_arguments():
    from tpserve.parsers.chat_output import ChatOutputConfig, ChatOutputParser

    text = ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {"b": ')
    single = ChatOutputParser(ChatOutputConfig(tool_parser="hermes", single_call=True))
    single.feed(text, final=True)
    assert [c.name for c in single.tool_calls] == ["f"] and single.finish_reason("stop") == "tool_calls"
    every = ChatOutputParser(ChatOutputConfig(tool_parser="hermes"))
    every.feed(text, final=True)
    assert every.finish_reason("stop") == "stop"  # all calls returned: the cut one keeps the reason


def test_vllm_structured_outputs_keys_at_their_defaults_are_accepted():
    """vLLM clients send dataclasses.asdict(StructuredOutputsParams(...)): every option key at its default (False,
    None) next to the one constraint. Those (and disable_fallback: xgrammar has no fallback) are accepted; an
    option set to ask for something (whitespace control) is a 400, and a structural tag beside the choice is two
    constraints (a 400 too)."""
    from tpserve.parsers.constraints import FieldError, vllm_structure

    sent = {"json": None, "regex": None, "choice": ["a", "b"], "grammar": None, "json_object": None,
            "disable_fallback": True, "disable_any_whitespace": False, "disable_additional_properties": False,
            "whitespace_pattern": None, "structural_tag": None, "_backend": None, "_backend_was_auto": False}
    assert vllm_structure(sent, "structured_outputs").kind == "ebnf"
    for key, value in (("disable_any_whitespace", True), ("whitespace_pattern", r"[ ]?")):
        with pytest.raises(FieldError, match=f"structured_outputs.{key} is not supported"):
            vllm_structure({**sent, key: value}, "structured_outputs")
    with pytest.raises(FieldError, match="not choice and structural_tag"):
        vllm_structure({**sent, "structural_tag": "{}"}, "structured_outputs")
    tag = vllm_structure({**sent, "choice": None, "structural_tag": '{"type": "structural_tag"}'}, "structured_outputs")
    assert (tag.kind, tag.spec) == ("structural_tag", '{"type": "structural_tag"}')


@pytest.mark.parametrize("text,in_reasoning,expected", [
    ("\n\ndef f():\n    pass", None, ("", "\n\ndef f():\n    pass")),  # no think block: the answer as written
    ("\nAnswer.", False, ("", "\nAnswer.")),  # thinking off (the prompt closed the block)
    ("\n<think>r</think>\n\nAnswer.", None, ("r", "Answer.")),  # after the output's own </think>: dropped
])
def test_only_the_newlines_after_the_outputs_think_block_are_dropped(text, in_reasoning, expected):
    """An answer's own leading newlines were dropped whenever a reasoning parser was on, though no think block
    preceded them (vLLM's qwen3 parser returns such output unchanged): content differed from the text."""
    for chunks in splits(text):
        assert run_reasoning(chunks, in_reasoning) == expected, chunks


@pytest.mark.parametrize("text,expected", [
    ("<think>\nplan a b</think>\n\nThe answer.", ("\nplan a b", "The answer.")),
    ("\n<think>plan</think>Done", ("plan", "Done")),
    ("plan <think> aside</think>Done", ("plan <think> aside", "Done")),  # not at the start: the reasoning's own text
    ("\n\nplan</think>Done", ("\n\nplan", "Done")),
    ("<thi", ("<thi", "")),
])
def test_a_think_tag_written_again_in_a_block_the_prompt_opened_is_markup(text, expected):
    """The template opened the block (QwQ, DeepSeek-R1-0528, Qwen3 thinking-2507) and the model writes <think> once
    more: it went to reasoning_content as text ("<think>\\nplan a b"); vLLM's parsers drop it."""
    for chunks in splits(text):
        assert run_reasoning(chunks, True) == expected, chunks


FIRST_CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'


@pytest.mark.parametrize("parser, text, content", [
    ("hermes", FIRST_CALL + '<tool_call>\n{"name": "g", "argu', '<tool_call>\n{"name": "g", "argu'),
    ("hermes", FIRST_CALL + '<tool_call>\n{"arguments": {"b": ', '<tool_call>\n{"arguments": {"b": '),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"parameters": {"b": ', '{"parameters": {"b": '),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "par', '{"name": "g", "par'),
])
def test_output_that_ends_inside_a_call_that_never_parsed_keeps_its_finish_reason(parser, text, content):
    """A stop string cut the second call before its JSON parsed (its block is content, as written): the output ended
    inside a call, so finish_reason stays "stop", as for a call cut inside its arguments; it was "tool_calls". With
    one call kept (parallel_tool_calls false), the first call closed before the cut one began: "tool_calls"."""
    from tpserve.parsers.chat_output import ChatOutputConfig, ChatOutputParser

    for single in (False, True):
        for chunks in splits(text):
            chat = ChatOutputParser(ChatOutputConfig(tool_parser=parser, single_call=single))
            got = "".join(chat.feed(chunk, final=i == len(chunks) - 1).content for i, chunk in enumerate(chunks))
            assert (got, [(c.name, c.arguments) for c in chat.tool_calls]) == (content, [("f", '{"a": 1}')]), chunks
            assert chat.finish_reason("stop") == ("tool_calls" if single else "stop"), chunks
            assert chat.finish_reason("length") == "length"


@pytest.mark.parametrize("parser, text", [
    ("hermes", FIRST_CALL + "<tool_call>\n{not json}\n</tool_call>"),  # closed by its tag: not a call, not cut
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {not json}'),
])
def test_a_closed_block_that_is_not_a_call_leaves_tool_calls_as_the_finish(parser, text):
    from tpserve.parsers.chat_output import ChatOutputConfig, ChatOutputParser

    chat = ChatOutputParser(ChatOutputConfig(tool_parser=parser))
    chat.feed(text, final=True)
    assert [c.name for c in chat.tool_calls] == ["f"] and chat.finish_reason("stop") == "tool_calls"
