"""Tool calls in model output, streamed as OpenAI does: a call's id and name first, then its
arguments in fragments, so the SDKs' stream accumulators rebuild it.

Parsers (``--tool-call-parser``):

* ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call, text before the first block is content. When the JSON starts with the
  name (as these models write it), the arguments stream as they are generated;
* ``qwen3_coder`` (Qwen3-Coder; Qwen3.5's templates too; ``parsers/qwen3_coder.py``):
  ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>``; a value
  is text, typed by the tool's JSON schema for it (vLLM's rule: integer, number, boolean, object/array parsed, else
  the text), and the arguments stream a parameter at a time;
* ``mistral`` (``parsers/mistral.py``): content, then ``[TOOL_CALLS]`` (a special token, kept in such requests'
  text) and a JSON array of ``{"name", "arguments"}`` (Mistral-7B-Instruct-v0.3, Mixtral-8x22B-Instruct), or
  ``NAME{arguments}`` after each call's own ``[TOOL_CALLS]`` (v11+ tokenizers: Mistral-Small-3.2, Magistral);
  call ids of 9 letters and digits;
* ``llama3_json`` (Llama 3.1/3.2): the whole output is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``, several separated by ``;``); each call streams as it is
  generated, as with hermes;
* ``pythonic`` (Llama 3.2/Llama 4/Gemma 3 with vLLM's pythonic templates, ToolACE; ``parsers/pythonic.py``): a
  Python list of calls, ``[get_weather(city="Paris"), lookup(id=3)]``, literal keyword arguments read with ``ast``,
  each call sent whole once it closes;
* ``granite`` (Granite 3.x): ``<|tool_call|>`` (or ``<tool_call>``) and a JSON array of ``{"name", "arguments"}``, the
  whole output calls or content as llama3_json's;
* ``phi4_mini_json`` (Phi-4-mini with vLLM's template; ``parsers/mistral.py``): content, then ``functools[`` and a
  JSON array of ``{"name", "arguments"}``, read as mistral's array.

With ``tool_choice`` "required" or a named function, decoding is constrained by a grammar to a
JSON array of calls (``[{"name": ..., "parameters": {...}}]``) or to the named function's
arguments, and ``ForcedToolCalls`` reads that.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tpserve.parsers.partial import partial_suffix_len

TOOL_CALL_PARSERS = ("hermes", "qwen3_coder", "llama3_json", "mistral", "pythonic", "granite", "phi4_mini_json")
# parsers whose start marker is a special token, which a request's text must then keep (skip_special_tokens off)
NEEDS_SPECIAL_TOKENS = ("mistral",)


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: the first piece has its id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        out: dict[str, Any] = {"index": self.index, "function": function}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        return out


@dataclass
class ToolParse:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def merge_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One delta per call (a chunk carries each call's index once, as OpenAI sends them)."""
    merged: list[ToolCallDelta] = []
    for d in deltas:
        if merged and merged[-1].index == d.index and d.id is None:
            merged[-1] = ToolCallDelta(d.index, merged[-1].id, merged[-1].name, merged[-1].arguments + d.arguments)
        else:
            merged.append(d)
    return merged


def _arguments_text(value: Any) -> str:
    """Arguments as JSON text: a JSON string holding JSON (OpenAI's own layout) its text, any other value encoded (a
    string that holds no JSON too, as vLLM's: its text alone was no JSON for the client to parse)."""
    if isinstance(value, str):
        try:
            json.loads(value)
            return value
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)


def _call_from_json(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a decoded call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], _arguments_text(args)


class _JsonStrings:
    """Whether each character of a growing JSON text lies inside a string (each character read once)."""

    def __init__(self) -> None:
        self._scanned = 0
        self._in_string = self._escaped = False

    def _step(self, c: str) -> bool:
        """Reads ``c``; whether it is outside every string (a quote that opens or closes one is not)."""
        self._scanned += 1
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
            return False
        if c == '"':
            self._in_string = True
            return False
        return True


class _TagOutsideStrings(_JsonStrings):
    """Where ``tag`` first occurs in a growing text outside its JSON strings (a call's end tag: the same characters
    inside an argument string are the argument's). A raw line break ends a string here: JSON writes it escaped, so
    the model has left the string (a call cut off mid-string, then closed on the next line)."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def find(self, text: str) -> int:
        """The tag's index, or -1 while it is not (yet) there: a tail that may be its start is read again later."""
        while self._scanned < len(text):
            i = self._scanned
            if not self._in_string and text.startswith(self.tag[: len(text) - i], i):
                if len(text) - i >= len(self.tag):
                    return i
                return -1  # the tag's start, or not: known once more text comes
            if self._in_string and text[i] == "\n":
                self._in_string = self._escaped = False
            self._step(text[i])
        return -1


class _ObjectEnd(_JsonStrings):
    """Where the JSON object a text starts with closes, read as the text grows (each character once)."""

    def __init__(self) -> None:
        super().__init__()
        self.end: int | None = None  # the index after the closing brace, once found
        self._depth = 0

    def find(self, text: str) -> int | None:
        while self.end is None and self._scanned < len(text):
            c = text[self._scanned]
            if not self._step(c):
                continue
            if c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.end = self._scanned
        return self.end


class ToolCallParser:
    """Base: feed text chunks, get content and call deltas; ``calls`` accumulates the calls."""

    def __init__(self) -> None:
        self.calls: list[ToolCallDelta] = []  # whole calls so far (id, name, full arguments)
        self._buffer = ""  # text read but not yet parsed
        self._call: ToolCallDelta | None = None  # the call whose arguments are streaming
        self._args_sent = 0  # characters of the streaming call's arguments text sent
        self._args_end = _ObjectEnd()  # where the streaming call's arguments object closes
        # the call the output ended inside (max_tokens or a stop string), by index: its arguments never closed, or
        # its JSON never parsed (then it is content, as written)
        self.cut_at: int | None = None

    @property
    def cut_short(self) -> bool:
        return self.cut_at is not None

    def feed(self, text: str, final: bool = False) -> ToolParse:
        raise NotImplementedError

    @staticmethod
    def new_call_id() -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def _start_call(self, name: str, out: ToolParse) -> ToolCallDelta:
        call = ToolCallDelta(len(self.calls), self.new_call_id(), name)
        self.calls.append(call)
        out.calls.append(ToolCallDelta(call.index, call.id, name))
        return call

    def _add_arguments(self, call: ToolCallDelta, text: str, out: ToolParse) -> None:
        if text:
            call.arguments += text
            out.calls.append(ToolCallDelta(call.index, arguments=text))

    def _whole_call(self, name: str, arguments: str, out: ToolParse) -> None:
        self._add_arguments(self._start_call(name, out), arguments, out)

    def _stream_call(self, body: str, out: ToolParse) -> None:
        """Start the call once ``body`` (its JSON so far) names it first and its arguments object
        has begun, then send what it adds to the arguments, up to the object's closing brace (a
        key after the arguments, or junk after the object, is not part of them). Arguments written
        as a JSON string are not streamed (the call goes out whole, its arguments the string's text)."""
        match = _NAME_FIRST.match(body)
        if match is None:
            return
        args = body[match.end():]
        if self._call is None:
            if not args.startswith("{"):  # not begun, or a JSON string: sent whole when it closes
                return
            try:
                name = json.loads(f'"{match.group(1)}"', strict=False)
            except json.JSONDecodeError:  # a bad escape in the name: not a call (it does not parse whole either)
                return
            self._call = self._start_call(name, out)
            self._args_sent, self._args_end = 0, _ObjectEnd()
        end = self._args_end.find(args)
        upto = len(args) if end is None else end
        if upto > self._args_sent:
            self._add_arguments(self._call, args[self._args_sent:upto], out)
            self._args_sent = upto

    def _close_call(self, body: str, out: ToolParse, closed: bool = False) -> bool:
        """``body``, a call's whole JSON as written (``closed`` by the format's end tag, or cut short by the output's
        end): True if it is a streamed call, which ends here whatever follows its arguments (so a call reads the same
        streamed or whole); False if it is still to be parsed and sent whole. A call closed by its tag is a call,
        whatever its arguments (as OpenAI's, they need not parse); one cut short leaves the finish reason as it is."""
        self._stream_call(body, out)
        if self._call is None:
            return False
        if self._args_end.end is None and not closed:
            self.cut_at = self._call.index
        self._call = None
        return True


_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class HermesParser(ToolCallParser):
    def __init__(self) -> None:
        super().__init__()
        self._in_call = False
        # Content between or after calls that is only whitespace is dropped, however it is chunked:
        # such whitespace waits here until text follows it in the same stretch of content.
        self._pending_space = ""
        self._stretch_has_text = False
        self._end = _TagOutsideStrings(_HERMES_END)  # the open call's end tag

    def feed(self, text: str, final: bool = False) -> ToolParse:
        out = ToolParse()
        self._buffer += text
        while True:
            if not self._in_call and not self._enter_block(final, out):
                return out
            if not self._read_block(final, out):
                return out

    def _read_block(self, final: bool, out: ToolParse) -> bool:
        """Read the open block; True once it has ended (the text after it is left in the buffer)."""
        end = self._end.find(self._buffer)
        if end < 0 and not final:
            self._stream_call(self._buffer[: len(self._buffer) - partial_suffix_len(self._buffer, (_HERMES_END,))], out)
            return False
        body = self._buffer if end < 0 else self._buffer[:end]
        self._buffer = "" if end < 0 else self._buffer[end + len(_HERMES_END):]
        self._in_call = False
        self._finish_call(body, end >= 0, out)
        return end >= 0

    def _enter_block(self, final: bool, out: ToolParse) -> bool:
        """The content up to the next ``<tool_call>``; True once past it (a block is open), False to wait for more
        text (a tag's first characters are held back until the text shows they are none)."""
        i = self._buffer.find(_HERMES_START)
        if i < 0:
            keep = 0 if final else partial_suffix_len(self._buffer, (_HERMES_START,))
            self._emit_content(self._buffer[: len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._emit_content(self._buffer[:i], out)
        self._buffer = self._buffer[i + len(_HERMES_START):]
        self._in_call = True
        self._pending_space, self._stretch_has_text = "", False
        self._block_opened()
        return True

    def _block_opened(self) -> None:
        self._end = _TagOutsideStrings(_HERMES_END)

    def _emit_content(self, text: str, out: ToolParse) -> None:
        if not self.calls or self._stretch_has_text:
            out.content += text
        elif text.strip():
            out.content += self._pending_space + text
            self._pending_space, self._stretch_has_text = "", True
        else:
            self._pending_space += text  # whitespace between or after calls, so far

    def _finish_call(self, body: str, closed: bool, out: ToolParse) -> None:
        if self._close_call(body, out, closed):
            return
        try:
            parsed = _call_from_json(json.loads(body, strict=False))
        except json.JSONDecodeError:
            parsed = None
        if parsed is None:
            out.content += f"{_HERMES_START}{body}{_HERMES_END if closed else ''}"  # not a call: as written
            if not closed:  # the output ended inside the block
                self.cut_at = len(self.calls)
        else:
            self._whole_call(*parsed, out)


class Llama3JsonParser(ToolCallParser):
    """The output is either tool calls or plain content, decided by its first non-blank
    characters; a call whose JSON does not start with its name is sent whole when it closes.
    Output that turns out not to be calls is content."""

    PYTHON_TAG = "<|python_tag|>"
    SEPARATORS = " \t\r\n;"  # between calls

    def __init__(self) -> None:
        super().__init__()  # _buffer, in calls mode: from the start of the object not yet closed
        self._text = ""  # everything, until a call goes out: content if none ever does
        self._mode: str | None = None  # "calls" or "content" once known
        self._decoder = json.JSONDecoder(strict=False)

    def feed(self, text: str, final: bool = False) -> ToolParse:
        out = ToolParse()
        self._buffer += text
        if not self.calls and self._mode != "content":  # content for good: the text is never needed again
            self._text += text
        if self._mode is None:
            head = self._buffer.lstrip()
            start = self._calls_start(head)
            if start is not None and start >= 0:
                self._mode = "calls"
                self._buffer = head[start:]
            elif start is not None or final:
                self._mode = "content"
            else:
                return out
        if self._mode == "calls":
            self._read_calls(final, out)
        if self._mode != "calls":
            out.content, self._buffer = out.content + self._buffer, ""
        return out

    def _calls_start(self, head: str) -> int | None:
        """Where the calls begin in ``head``, the output from its first non-blank character: -1 if the output is
        content, None while it may still be either (empty, or the start of a tag)."""
        if head.startswith("{"):
            return 0
        if head.startswith(self.PYTHON_TAG):
            return len(self.PYTHON_TAG)
        return None if self.PYTHON_TAG.startswith(head) else -1

    def _read_calls(self, final: bool, out: ToolParse) -> None:
        while True:
            self._buffer = self._buffer.lstrip(self.SEPARATORS)
            if not self._buffer:
                return
            if not self._buffer.startswith("{"):
                self._to_content()
                return
            try:
                obj, end = self._decoder.raw_decode(self._buffer)
            except (json.JSONDecodeError, RecursionError):  # not closed yet (or cut short, or nested past the depth)
                if not final:
                    self._stream_call(self._buffer, out)
                elif self._close_call(self._buffer, out):
                    self._buffer = ""
                else:  # not a call: content, as written
                    if _ObjectEnd().find(self._buffer) is None:  # the output ended inside the object
                        self.cut_at = len(self.calls)
                    self._to_content()
                return
            body, self._buffer = self._buffer[:end], self._buffer[end:]
            if self._close_call(body, out):
                continue
            parsed = _call_from_json(obj)
            if parsed is None:
                self._buffer = body + self._buffer
                self._to_content()
                return
            self._whole_call(*parsed, out)

    def _to_content(self) -> None:
        """Not calls after all: everything (or, once calls went out, the rest) is content."""
        self._mode = "content"
        if not self.calls:
            self._buffer = self._text


class GraniteParser(Llama3JsonParser):
    """``granite`` (IBM Granite 3.x), as vLLM's: the whole output is either calls or content, by its first non-blank
    characters: ``<|tool_call|>`` (Granite 3.x's; where a tokenizer makes it a special token, skipped as special
    tokens are by default, only the array is in the text) and/or ``<tool_call>`` (3.1), then a JSON array of ``{"name", "arguments"}``, each call streamed as
    llama3_json's; or the array alone. After a tag an object alone is a call too (vLLM: content); text after the
    array is content (vLLM: the whole output content)."""

    TAGS = ("<|tool_call|>", "<tool_call>")  # vLLM strips them in this order, each optional
    SEPARATORS = " \t\r\n,[]"

    def _calls_start(self, head: str) -> int | None:
        i, tagged = 0, False
        for tag in self.TAGS:
            rest = head[i:]
            if rest.startswith(tag):
                i, tagged = len(head) - len(rest[len(tag):].lstrip()), True
            elif rest and tag.startswith(rest):
                return None  # may still be the tag
        rest = head[i:]
        if rest.startswith("[") or (tagged and rest.startswith("{")):
            return i
        return None if not rest else -1


class ForcedToolCalls(ToolCallParser):
    """Output constrained to a JSON array of ``{"name", "parameters"}`` (tool_choice "required")
    or to one function's arguments (``function_name`` set: a named tool_choice)."""

    def __init__(self, function_name: str | None = None) -> None:
        super().__init__()
        self._function_name = function_name

    def feed(self, text: str, final: bool = False) -> ToolParse:
        out = ToolParse()
        self._buffer += text
        if not final:
            return out
        try:
            value = json.loads(self._buffer, strict=False)
        except json.JSONDecodeError:  # cut short (max_tokens): show what was written
            out.content, self._buffer = self._buffer, ""
            return out
        if self._function_name is not None:
            self._whole_call(self._function_name, _arguments_text(value), out)
        else:
            for item in value if isinstance(value, list) else [value]:
                parsed = _call_from_json(item)
                if parsed is not None:
                    self._whole_call(*parsed, out)
        self._buffer = ""
        return out


# the call list that pythonic templates show: "[func_name1(params_name1=params_value1, ...), func_name2(params)]"
_PYTHONIC_EXAMPLE = re.compile(r"\[func_name1?\(")


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser for the tool-call format a chat template teaches the model, if recognisable."""
    template = chat_template or ""
    if "<function=" in template:
        return "qwen3_coder"
    if "<|tool_call|>" in template:  # Granite 3.x's ("respond only with <|tool_call|> followed by a JSON list")
        return "granite"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "functools[" in template:  # vLLM's Phi-4-mini template (Microsoft's own does not say how calls are written)
        return "phi4_mini_json"
    if _PYTHONIC_EXAMPLE.search(template):  # vLLM's Llama 3.2/Llama 4/Gemma 3 pythonic templates, ToolACE's
        return "pythonic"
    if "<|python_tag|>" in template or ("tools" in template and '"parameters"' in template):
        return "llama3_json"
    return None
