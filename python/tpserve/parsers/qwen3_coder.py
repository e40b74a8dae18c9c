"""The ``qwen3_coder`` tool-call format (Qwen3-Coder; Qwen3.5's templates too), as vLLM's parser reads it:
``<tool_call>`` blocks of ``<function=NAME>`` blocks of ``<parameter=P>`` values, each value text typed by the tool's
JSON schema for it (``typed_parameter``); the arguments stream a parameter at a time."""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any

from tpserve.parsers.tool_calls import _HERMES_END, _HERMES_START, HermesParser, ToolParse

_FUNCTION, _PARAMETER, _PARAMETER_END, _FUNCTION_END = "<function=", "<parameter=", "</parameter>", "</function>"
_INT_TYPES = ("int", "uint", "long", "short", "unsigned")


def _schema_type(schema: Any) -> tuple[str, bool]:
    """(the type a parameter's JSON schema gives it, whether it admits null), as vLLM reads them: ``type``, else an
    ``anyOf``'s first type other than null (Pydantic's ``Optional[T]``), else string."""
    if isinstance(schema, dict) and "type" in schema:
        kind = str(schema["type"]).strip().lower()
        return kind, kind == "null"
    if isinstance(schema, dict) and isinstance(schema.get("anyOf"), list):
        kinds = [str(option["type"]).strip().lower() for option in schema["anyOf"]
                 if isinstance(option, dict) and "type" in option]
        others = [kind for kind in kinds if kind != "null"]
        return (others[0] if others else "string"), "null" in kinds
    return "string", False


def typed_parameter(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as the type its JSON schema gives it (vLLM's rule; text where it does not
    convert). ``schema`` None: the tool does not declare the parameter (its text as written)."""
    if schema is None:
        return value
    kind, nullable = _schema_type(schema)
    if nullable and value.lower() in ("null", "none"):
        return None
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value  # a string's "null" is its text, unless the schema admits null
    if value.lower() in ("null", "none"):
        return None
    if kind.startswith(_INT_TYPES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    container = kind in ("object", "array", "arr") or kind.startswith(("dict", "list"))
    if container:
        try:
            parsed = json.loads(value)
            # a Python repr JSON-encoded by a buggy template ("{'k': 'v'}" in quotes): decoded once more
            return _literal(parsed) if isinstance(parsed, str) else parsed
        except (json.JSONDecodeError, RecursionError):  # (nested past the decoder's depth: its text, as _literal's)
            pass
    parsed = _literal(value)
    return _literal(parsed) if container and isinstance(parsed, str) and parsed is not value else parsed


def _literal(value: str) -> Any:
    try:
        return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value


def _json_value(value: Any, text: str) -> str:
    """A typed value as JSON; its text where it has no JSON form (a set or bytes from a Python literal, NaN)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return json.dumps(text, ensure_ascii=False)


class Qwen3CoderParser(HermesParser):
    """``qwen3_coder``: each ``<tool_call>`` block holds ``<function=NAME>`` blocks of ``<parameter=P>`` values. A
    call starts once its name is read; each parameter goes out as its value closes (at ``</parameter>``, or at the
    next parameter or the function's end, as vLLM reads them), the arguments being the JSON object of the typed
    values so far. ``tool_params``: each function's parameter schemas (its JSON schema's properties)."""

    def __init__(self, tool_params: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        super().__init__()
        self._tool_params = tool_params or {}
        self._params = 0  # parameters the open call has sent
        self._block_has_call = False  # a block with no function in it is content, as written

    def _block_opened(self) -> None:
        self._block_has_call = False

    def _read_block(self, final: bool, out: ToolParse) -> bool:
        """Read the open block; True once it has ended (the text after it is left in the buffer)."""
        while True:
            body = self._buffer.lstrip()
            if self._call is not None:
                if not self._read_parameter(body, final, out):
                    return False
                continue
            if body.startswith(_FUNCTION) and (j := body.find(">")) >= 0:
                self._call, self._params = self._start_call(body[len(_FUNCTION):j], out), 0
                self._buffer, self._block_has_call = body[j + 1:], True
                continue
            end = body.find(_HERMES_END)
            if end < 0 and not final:
                return False  # a function or the block's end still coming
            text = self._buffer[: len(self._buffer) - len(body) + (len(body) if end < 0 else end)]
            self._buffer = "" if end < 0 else body[end + len(_HERMES_END):]
            self._in_call = False
            if not self._block_has_call:
                out.content += f"{_HERMES_START}{text}{_HERMES_END if end >= 0 else ''}"
                if end < 0:  # the output ended inside it
                    self.cut_at = len(self.calls)
            return True

    def _read_parameter(self, body: str, final: bool, out: ToolParse) -> bool:
        """One step of the open call (``body``: its text so far, from the next tag): a parameter, or the call's end;
        False to wait for more text."""
        call = self._call
        closed = body.startswith(_FUNCTION_END) or body.startswith(_HERMES_END)
        if closed or (final and not body.startswith(_PARAMETER)):
            self._add_arguments(call, "}" if self._params else "{}", out)
            if not closed:  # the output ended inside the call
                self.cut_at = call.index
            self._call = None
            self._buffer = body.removeprefix(_FUNCTION_END) if closed else ""
            return True
        if not body.startswith(_PARAMETER):
            if any(tag.startswith(body) for tag in (_PARAMETER, _FUNCTION_END, _HERMES_END)):
                return False  # a tag still coming
            self._buffer = body[1:]  # a stray character between parameters
            return True
        j = body.find(">")
        ends = [] if j < 0 else [k for tag in (_PARAMETER_END, _PARAMETER, _FUNCTION_END, _HERMES_END)
                                 if (k := body.find(tag, j + 1)) >= 0]
        if not ends and not final:
            return False
        name = body[len(_PARAMETER): j if j >= 0 else len(body)]
        end = min(ends) if ends else len(body)
        value = body[j + 1: end].removeprefix("\n").removesuffix("\n") if j >= 0 else ""
        schemas = self._tool_params.get(call.name or "")
        typed = typed_parameter(value, schemas.get(name) if isinstance(schemas, Mapping) else None)
        piece = f"{json.dumps(name, ensure_ascii=False)}: {_json_value(typed, value)}"
        self._add_arguments(call, ("{" if self._params == 0 else ", ") + piece, out)
        self._params += 1
        self._buffer = body[end:].removeprefix(_PARAMETER_END)
        return True
