"""The ``pythonic`` tool-call format (Llama 3.2 and Llama 4 with vLLM's pythonic templates, ToolACE, Gemma 3 with
vLLM's template): a Python list of calls, ``[get_weather(city="Paris", unit="celsius"), lookup(id=3)]``, each call a
function name and keyword arguments that are literals (strings, numbers, booleans, None, lists and dicts of them),
read with Python's ``ast`` and sent as JSON.

vLLM's parser takes an output that is the list and nothing else (one that starts with ``[``); here the list may
follow text (that text is content), and text after it is content too. A list is a call list from a ``[`` followed
by a name and ``(``; each call goes out whole (id, name and arguments in one delta) once it is closed and followed by
``,`` or ``]``, checked by ``ast``. A call that is not one (a positional argument, a value that is no literal, a
name that is not a plain one, brackets that do not match) is content as written: the list's text from its ``[`` if
it was the list's first call, else from that call on (the calls before it have gone out). vLLM streams a call's
arguments as they are generated, rebuilding the list's partial text each time; it sends nothing for an output
whose list turns out not to parse after it has begun (and returns the whole text as content when not streaming).
Here a call goes out only once it is known to be one, so the stream and the whole response always agree.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from tpserve.parsers.tool_calls import HermesParser, ToolParse

# a call list's start: "[", a name, "("; and what may still grow into one
_START = re.compile(r"\[\s*[^\W\d]\w*\s*\(")
_MAYBE_START = re.compile(r"\[\s*(?:[^\W\d]\w*\s*)?")
_FIRST_HEAD = re.compile(r"\s*[^\W\d]\w*\s*\(")  # the first call's start, after the "["
_NEXT_HEAD = re.compile(r"\s*,\s*[^\W\d]\w*\s*\(")  # a later call's, from the "," after the last
_MAYBE_NEXT_HEAD = re.compile(r"\s*(?:,\s*(?:[^\W\d]\w*\s*)?)?")
_TRAILING_COMMA = re.compile(r"\s*,\s*\]")  # a list's end after its last call's comma (Python's)
_CLOSE = {")": "(", "]": "[", "}": "{"}


class NotACall(ValueError):
    pass


def _literal(node: ast.expr) -> Any:
    """The value of a literal: a string, number, boolean or None, or a list or dict of them (a dict's keys
    constants); a negative number too (vLLM's takes no ``-1``: an operator, not a constant)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value  # (bool is an int)
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        if not all(isinstance(key, ast.Constant) for key in node.keys):  # (a ** spread has no key)
            raise NotACall("a dict's keys must be constants")
        return {key.value: _literal(value) for key, value in zip(node.keys, node.values)}  # type: ignore[union-attr]
    raise NotACall("arguments must be literals")


def parse_call(text: str) -> tuple[str, str]:
    """(name, arguments as JSON) of one call's text, ``name(key=literal, ...)``; NotACall if it is not one."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise NotACall(str(e)) from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise NotACall("not a call of a name")
    names = [keyword.arg for keyword in node.keywords]
    if node.args or None in names:
        raise NotACall("arguments must be given by name")
    if len(set(names)) < len(names):  # (ast reads it; Python does not)
        raise NotACall("an argument given twice")
    try:
        arguments = {keyword.arg: _literal(keyword.value) for keyword in node.keywords}
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError) as e:  # NaN or infinity; nested past the encoder's depth
        raise NotACall(str(e)) from None


class _CallScanner:
    """Where a call's text, from just after its ``(``, closes: brackets matched, Python strings (quotes of either
    kind, tripled or not, backslash escapes) skipped; read as the text grows, each character once."""

    def __init__(self) -> None:
        self.pos = 0  # the next character to read
        self._stack = ["("]
        self._quote = ""  # the open string's quote ("'", '"', "'''" or '"""'), "" outside strings
        self._escaped = False
        self._end: int | None = None  # once found

    def scan(self, text: str, final: bool) -> int | None:
        """The index after the call's ``)``; None while it is not there; -1 where the text cannot be a call (a
        bracket closing another's, a one-line string running past its line). ``pos`` is then where that shows."""
        while self._end is None and self.pos < len(text):
            i, c = self.pos, text[self.pos]
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == "\n" and len(self._quote) == 1:
                    return -1
                elif text.startswith(self._quote, i):
                    self.pos += len(self._quote)
                    self._quote = ""
                    continue
                elif len(self._quote) == 3 and c == self._quote[0] and not final and len(text) - i < 3:
                    return None  # the closing quotes may be coming
                self.pos += 1
                continue
            if c in "'\"":
                if text.startswith(c * 3, i):
                    self._quote = c * 3
                elif not final and text[i:] in (c, c * 2):
                    return None  # a tripled quote, or not: known once more text comes
                else:
                    self._quote = c
                self.pos += len(self._quote)
                continue
            if c in "([{":
                self._stack.append(c)
            elif c in _CLOSE:
                if self._stack.pop() != _CLOSE[c]:
                    return -1
                if not self._stack:
                    self._end = self.pos + 1
                    return self._end
            self.pos += 1
        return self._end


class PythonicParser(HermesParser):
    """``pythonic``: a list of calls is a block, as hermes's ``<tool_call>`` (content around it, whitespace alone
    between or after blocks dropped); its calls go out one by one, each whole once ast reads it as a call."""

    def __init__(self) -> None:
        super().__init__()
        self._calls_here = 0  # calls the open list has sent
        self._scanner: _CallScanner | None = None  # the open call's, from after its "("
        self._head = 0  # where the open call's text begins in the buffer

    def _enter_block(self, final: bool, out: ToolParse) -> bool:
        """The content up to the next call list's ``[``; True once past it, False to wait for more text (a ``[``
        that may start one is held back until the text shows whether it does)."""
        i = self._buffer.find("[")
        while i >= 0:
            if _START.match(self._buffer, i):
                self._emit_content(self._buffer[:i], out)
                self._buffer = self._buffer[i + 1:]
                self._in_call, self._calls_here, self._scanner = True, 0, None
                return True
            if not final and _MAYBE_START.fullmatch(self._buffer, i):
                self._emit_content(self._buffer[:i], out)
                self._buffer = self._buffer[i:]
                return False
            i = self._buffer.find("[", i + 1)
        self._emit_content(self._buffer, out)
        self._buffer = ""
        return False

    def _read_block(self, final: bool, out: ToolParse) -> bool:
        """Read the open list (``_buffer``: its text after the ``[``, or from the ``,`` after its last call); True
        once it has ended, as a list or as content (the text after it is left in the buffer)."""
        while True:
            if self._scanner is None:
                head = (_NEXT_HEAD if self._calls_here else _FIRST_HEAD).match(self._buffer)
                if head is None:  # (never for the first call: the list began with one's head)
                    if end := _TRAILING_COMMA.match(self._buffer):
                        return self._close_list(end.end())
                    if _MAYBE_NEXT_HEAD.fullmatch(self._buffer):
                        if not final:
                            return False
                        if not self._buffer.strip(" \t\r\n,"):  # the output ended after a call's comma
                            return self._close_list(len(self._buffer))
                        return self._not_a_call(len(self._buffer), out, cut=True)  # ... or inside a name
                    return self._not_a_call(0, out)
                self._head, self._scanner = head.end(), _CallScanner()
            end = self._scanner.scan(self._buffer[self._head:], final)
            if end is None:
                if not final:
                    return False
                return self._not_a_call(len(self._buffer), out, cut=True)
            if end < 0:
                return self._not_a_call(self._head + self._scanner.pos, out)
            end += self._head
            after = self._buffer[end:].lstrip()
            if not after and not final:
                return False  # "," or "]" (or not) still coming
            if after and after[0] not in ",]":
                return self._not_a_call(len(self._buffer) - len(after), out)
            try:
                name, arguments = parse_call(self._buffer[:end].lstrip(" \t\r\n,"))
            except NotACall:
                return self._not_a_call(end, out)
            if not self._calls_here:  # blanks between lists (or after the last) are dropped, as hermes's
                self._pending_space, self._stretch_has_text = "", False
            self._whole_call(name, arguments, out)
            self._calls_here += 1
            self._scanner = None
            sep = len(self._buffer) - len(after)
            if not after or after[0] == "]":
                return self._close_list(sep + 1 if after else sep)
            self._buffer = self._buffer[sep:]

    def _close_list(self, end: int) -> bool:
        self._buffer, self._in_call = self._buffer[end:], False
        return True

    def _not_a_call(self, upto: int, out: ToolParse, cut: bool = False) -> bool:
        """The open call is none: its text up to ``upto`` (where that showed) is content, as written, the list's
        ``[`` too if no call of it went out; the text after it is read as content (a list may start in it). ``cut``:
        the output ended inside the call."""
        self._emit_content(("" if self._calls_here else "[") + self._buffer[:upto], out)
        if cut:
            self.cut_at = len(self.calls)
        self._buffer, self._in_call, self._scanner = self._buffer[upto:], False, None
        return True
