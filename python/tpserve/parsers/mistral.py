"""The ``mistral`` tool-call format, both of its layouts as vLLM's parser reads them: content, then the special token
``[TOOL_CALLS]`` and

* (tokenizers before v11: Mistral-7B-Instruct-v0.3, Mixtral-8x22B-Instruct) a JSON array of ``{"name", "arguments"}``
  objects, each streamed as llama3_json's;
* (v11 and later: Mistral-Small-3.2, Magistral, Devstral) the call's name and its arguments' JSON, ``[TOOL_CALLS]``
  again before each further call; some templates write ``[ARGS]`` between the two (``[TOOL_CALLS]name[ARGS]{...}``).

vLLM tells the layouts apart by the tokenizer (a v11+ one has an ``[ARGS]`` token); here the text after the first
``[TOOL_CALLS]`` does, which agrees for what either model writes: an array (or an object) after it is the old layout,
a name the new one. Call ids are 9 letters and digits: Mistral's templates refuse any other id in the calls sent back.
"""

from __future__ import annotations

import random
import string

from tpserve.parsers.partial import partial_suffix_len
from tpserve.parsers.tool_calls import Llama3JsonParser, ToolCallParser, ToolParse, _ObjectEnd

TOKEN = "[TOOL_CALLS]"  # a special token: such requests keep special tokens in their text (NEEDS_SPECIAL_TOKENS)
ARGS = "[ARGS]"  # v11+ tokenizers' token between a call's name and its arguments


def names_first(text: str, final: bool) -> bool | None:
    """Whether the calls after the first ``[TOOL_CALLS]`` (``text``: what follows it) are written name first (the
    v11+ layout); None while the text is too short to tell."""
    head = text.lstrip()
    if head.startswith(ARGS) or head[:1] not in ("", "[", "{"):
        return True
    if head and not ARGS.startswith(head):
        return False  # a JSON array or object
    return False if final else None


class MistralParser(Llama3JsonParser):
    """``mistral``: the old layout read by llama3_json's machinery (its separators the array's brackets and commas);
    the new one by ``_read_named``. A v11+ call's arguments are the text from its ``{`` to the next ``[TOOL_CALLS]`` or
    the output's end, as vLLM's (which returns them as written, parsed or not, so the model sees the call it made)."""

    SEPARATORS = " \t\r\n,[]"
    TOKEN = TOKEN  # what starts the calls

    def __init__(self) -> None:
        super().__init__()
        self._names_first: bool | None = None  # the layout, once the text after the first token shows it

    @staticmethod
    def new_call_id() -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def feed(self, text: str, final: bool = False) -> ToolParse:
        out = ToolParse()
        self._buffer += text
        if self._mode is None:  # content up to the token
            i = self._buffer.find(self.TOKEN)
            if i < 0:
                keep = 0 if final else partial_suffix_len(self._buffer, (self.TOKEN,))
                cut = len(self._buffer) - keep
                out.content, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return out
            out.content, self._buffer, self._mode = self._buffer[:i], self._buffer[i + len(self.TOKEN):], "calls"
            self._text = self.TOKEN + self._buffer  # content after all if no call parses
        elif not self.calls and self._mode == "calls":
            self._text += text
        if self._mode == "calls" and self._names_first is None:
            self._names_first = names_first(self._buffer, final)
            if self._names_first is None:
                return out
        if self._names_first:
            self._read_named(final, out)
        elif self._mode == "calls":
            self._read_calls(final, out)
        if self._mode == "content":
            out.content, self._buffer = out.content + self._buffer, ""
        return out

    def _read_named(self, final: bool, out: ToolParse) -> None:
        """v11+ calls: ``_buffer`` holds the text after a ``[TOOL_CALLS]``, from the open call's ``{`` once its name
        is read (``_args_sent`` of it sent)."""
        while True:
            token = self._buffer.find(self.TOKEN)
            closed = token >= 0 or final  # this call's text is all here
            end = token if token >= 0 else len(self._buffer) - (0 if final else partial_suffix_len(self._buffer,
                                                                                                  (self.TOKEN,)))
            if self._call is None:
                if self._open_named(end, closed, token >= 0, out) or token >= 0:
                    continue  # read on from the call's arguments, or from the next token
                return
            self._args_end.find(self._buffer[:end])
            if end > self._args_sent:
                self._add_arguments(self._call, self._buffer[self._args_sent:end], out)
                self._args_sent = end
            if not closed:
                return
            if token < 0 and self._args_end.end is None:  # the output ended inside the arguments
                self.cut_at = self._call.index
            self._call = None
            self._buffer = "" if token < 0 else self._buffer[token + len(self.TOKEN):]
            if token < 0:
                return

    def _open_named(self, end: int, closed: bool, more: bool, out: ToolParse) -> bool:
        """Start the call whose name ``_buffer[:end]`` holds up to its ``{``. False while the name is still coming,
        or where the text up to the next token (``more``) or the output's end holds no call: that is content, as
        written (vLLM drops it)."""
        brace = self._buffer.find("{", 0, end)
        name = self._buffer[:brace].replace(ARGS, "").strip() if brace >= 0 else ""
        if name:
            self._call = self._start_call(name, out)
            self._buffer, self._args_sent, self._args_end = self._buffer[brace:], 0, _ObjectEnd()
            return True
        if not closed:
            return False
        out.content += self.TOKEN + self._buffer[:end]
        if not more:  # the output ended inside it
            self.cut_at = len(self.calls)
        self._buffer = self._buffer[end + len(self.TOKEN):] if more else ""
        return False


class Phi4MiniJsonParser(MistralParser):
    """``phi4_mini_json`` (Phi-4-mini with vLLM's template, which asks for ``functools[{"name": ..., "arguments":
    ...}, ...]``): content, then ``functools[`` and the JSON array of calls (``arguments`` or ``parameters``), read as
    mistral's array layout, so the calls stream as they are written. vLLM's parser reads the whole output only
    (streamed, it sends nothing) and drops the text before ``functools[``; here that text is content, and an array
    that holds no call is content as written (vLLM: an array that does not parse is no content and no calls)."""

    TOKEN = "functools["

    def __init__(self) -> None:
        super().__init__()
        self._names_first = False  # only the array layout

    @staticmethod
    def new_call_id() -> str:
        return ToolCallParser.new_call_id()
