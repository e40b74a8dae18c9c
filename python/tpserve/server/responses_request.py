"""A Responses API request as the chat request that serves it: its input items (messages,
function calls and their outputs, reasoning) as chat messages, its flat function tools, ``tool_choice``,
``text.format`` and ``reasoning.effort`` as the chat forms. Errors name the Responses fields."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tpserve.server.chat_messages import part_text
from tpserve.server.errors import APIError
from tpserve.server.protocol import ChatCompletionRequest, thinking_kwargs
from tpserve.server.responses_protocol import ResponsesRequest
from tpserve.server.truncation import kept

# chat fields a Responses request may carry as extensions (vLLM's sampling extras), served or refused as chat's
CHAT_EXTENSIONS = frozenset({
    "seed", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "logit_bias", "allowed_token_ids", "bad_words", "skip_special_tokens",
    "chat_template_kwargs", "regex", "ebnf", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "truncate_prompt_tokens", "cache_salt", "priority", "chat_template",
})
INPUT_ROLES = ("user", "system", "developer", "assistant")


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part_text(part, f"{where}[{i}]", "input") for i, part in enumerate(content))  # as chat's parts
    raise APIError.invalid(f"{where} must be a string or a list of content parts", "input")


def _string_field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError.invalid(f"{where}.{name} must be a string", "input")
    return value


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise APIError.invalid(f"{where}.content must be a list of reasoning_text parts", "input")
    return "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


class _Messages:
    """Chat messages built item by item; a reasoning item goes with the assistant turn after it."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._reasoning: str | None = None

    def assistant(self, content: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self._reasoning is not None:
            msg["reasoning_content"], self._reasoning = self._reasoning, None
        self.messages.append(msg)
        return msg

    def add_call(self, call: dict[str, Any]) -> None:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self._reasoning is not None:
            last = self.assistant("")
        last.setdefault("tool_calls", []).append(call)

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise APIError.invalid(f"{where} must be an object (a message or a function call item)", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise APIError.invalid(f"{where}.role must be one of {', '.join(INPUT_ROLES)}, got {role!r}", "input")
            text = _content_text(item.get("content"), f"{where}.content")
            if role == "assistant":
                self.assistant(text)
            else:
                self._answer_reasoning()
                self.messages.append({"role": role, "content": text})
        elif kind == "function_call":
            name, arguments = _string_field(item, "name", where), _string_field(item, "arguments", where)
            function = {"name": name, "arguments": arguments}
            self.add_call({"id": _string_field(item, "call_id", where), "type": "function", "function": function})
        elif kind == "function_call_output":
            output = _content_text(item.get("output"), f"{where}.output")
            call_id = _string_field(item, "call_id", where)
            self._answer_reasoning()
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            self._reasoning = (self._reasoning or "") + _reasoning_text(item, where)
        else:
            raise APIError.invalid(f"{where}.type {kind!r} is not supported (only message, function_call, "
                                   "function_call_output and reasoning items are)", "input")

    def _answer_reasoning(self) -> None:
        """Reasoning that no answer followed (a response cut inside its thinking) is an assistant turn of its own,
        where it stands."""
        if self._reasoning is not None:
            self.assistant("")

    def finish(self) -> list[dict[str, Any]]:
        self._answer_reasoning()
        return self.messages


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return body.input


def chat_messages(instructions: str | None, items: list[dict[str, Any]], first_new: int = 0) -> list[dict[str, Any]]:
    """``instructions`` as the system message, then the items; ``first_new``: the index of the
    request's own first item (errors name ``input[i]`` from there; history items are already checked)."""
    built = _Messages()
    if instructions:
        built.messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        built.add(item, f"input[{i - first_new}]" if i >= first_new else f"previous_response_id item {i}")
    return built.finish()


def check_items(items: list[Any], param: str) -> None:
    """400 (naming ``param``) unless each item could be a response's input item."""
    built = _Messages()
    try:
        for i, item in enumerate(items):
            built.add(item, f"{param}[{i}]")
    except APIError as e:
        e.param = param
        raise


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise APIError.invalid(f"tools[{index}]: {kind!r} tools are not supported; only function tools "
                               "({\"type\": \"function\", \"name\": ...}) are", "tools")
    if isinstance(tool.get("function"), dict):  # the chat form, as some clients send it
        return tool
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # "auto", "none", "required"; anything else is a 400 from the chat checks
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "allowed_tools" and isinstance(choice.get("tools"), list):  # chat's nests it
        tools = [{"type": "function", "function": {"name": tool.get("name")}} if isinstance(tool, dict) else tool
                 for tool in choice["tools"]]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode", "auto"), "tools": tools}}
    raise APIError.invalid(f"tool_choice {choice!r} is not supported: give \"auto\", \"none\", \"required\", "
                           "{\"type\": \"function\", \"name\": ...} or {\"type\": \"allowed_tools\", \"mode\", \"tools\"}",
                           "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError.invalid(f'text.format must be an object such as {{"type": "json_object"}}, got {fmt!r}',
                               "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), (dict, bool)):
            raise APIError.invalid("text.format json_schema needs schema (a JSON schema)", "text.format")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise APIError.invalid(f"text.format type must be text, json_object or json_schema, got {kind!r}", "text.format")


def _template_kwargs(body: ResponsesRequest) -> dict[str, Any] | None:
    """chat_template_kwargs with ``reasoning.effort`` (``protocol.thinking_kwargs``)."""
    given = (body.model_extra or {}).get("chat_template_kwargs")
    if given is not None and not isinstance(given, dict):
        raise APIError.invalid("chat_template_kwargs must be an object", "chat_template_kwargs")
    return thinking_kwargs(given, (body.reasoning or {}).get("effort"), "reasoning.effort")


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]], start: int = 0) -> ChatCompletionRequest:
    """The chat request that serves ``body`` after the stored ``history``; ``start``: the
    conversation (history, then input) is cut to start at that item (``truncation.kept``)."""
    fields: dict[str, Any] = {k: v for k, v in (body.model_extra or {}).items() if k in CHAT_EXTENSIONS}
    items = kept(history + input_items(body), start)
    fields.update(
        model=body.model,
        messages=chat_messages(body.instructions, items, first_new=len(kept(history, min(start, len(history))))),
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=[_chat_tool(t, i) for i, t in enumerate(body.tools)] or None,
        tool_choice=_chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text),
        chat_template_kwargs=_template_kwargs(body),
        logprobs=body.wants_logprobs,
        top_logprobs=body.top_logprobs if body.wants_logprobs else None,
        user=body.user,
    )
    if not fields["messages"]:
        raise APIError.invalid("input must not be empty", "input")
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:  # an extension's value: answered as a body's validation error
        raise RequestValidationError(e.errors()) from e
