"""Chat messages as the chat template gets them, as vLLM's chat parser leaves them: content parts joined into text,
an assistant's past tool calls with their arguments as objects, its reasoning under both names."""

from __future__ import annotations

import json
from typing import Any

from tpserve.server.errors import APIError
from tpserve.server.limits import check_transportable

TEXT_PARTS = ("text", "input_text", "output_text")  # vLLM takes all three, in chat and in Responses items
UNSERVED_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "video_url", "file", "input_file")


def part_text(part: Any, where: str, param: str) -> str:
    """A content part's text (a chat message's or a Responses item's; ``param`` names the field in errors)."""
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "refusal" and isinstance(part.get("refusal"), str):  # an assistant turn's refusal, replayed
        return part["refusal"]
    if kind in UNSERVED_PARTS:
        raise APIError.invalid(f"{where}: {kind} content is not supported (tpserve serves text-only models)", param)
    example = "text" if param == "messages" else "input_text"
    raise APIError.invalid(f"{where}: a content part must be {{\"type\": \"{example}\", \"text\": ...}}", param)


def template_tool_call(call: Any, where: str) -> Any:
    """An assistant's tool call as vLLM hands it to the chat template: arguments as a JSON object (templates such as
    Llama 3.1's render them with ``tojson``); arguments that are no JSON, empty or null are ``{}`` (vLLM's
    ``_postprocess_messages``). Arguments holding what the tokenizer workers' messages cannot carry (an integer past 64
    bits, a lone surrogate escape: the request was a 500) stay the string given (Qwen3's template renders a string as
    it is). A call that is no ``{"function": {"name": str, "arguments": str}}`` is a 400, as vLLM's validation."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError.invalid(f'{where} must be {{"id", "type": "function", "function": {{"name": string, '
                               f'"arguments": string}}}}', "messages")
    arguments = function.get("arguments")
    if isinstance(arguments, dict):
        return call
    if arguments is not None and not isinstance(arguments, str):
        raise APIError.invalid(f"{where}.function.arguments must be a string (the call's arguments as JSON)", "messages")
    if arguments is None or not arguments.strip():  # a call without arguments: {} (as vLLM), not `"arguments": }`
        return {**call, "function": {**function, "arguments": {}}}
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):  # no JSON (or nested past the parser's depth): {} as vLLM renders it
        return {**call, "function": {**function, "arguments": {}}}
    try:
        check_transportable(parsed)
    except APIError:  # untransportable: the string as given
        return call
    return {**call, "function": {**function, "arguments": parsed}}


def assistant_for_template(msg: dict[str, Any], index: int) -> None:
    """An assistant message as vLLM's chat parser leaves it: its tool calls checked, their arguments as objects, an
    empty ``tool_calls`` dropped (templates such as Llama 3.1's test ``'tool_calls' in message``), and its reasoning
    under both names (``reasoning`` wins over the older ``reasoning_content``, as in vLLM)."""
    if "tool_calls" in msg:
        calls = msg["tool_calls"]
        if not isinstance(calls, list):
            raise APIError.invalid(f"messages[{index}].tool_calls must be a list of tool calls", "messages")
        if calls:
            msg["tool_calls"] = [template_tool_call(c, f"messages[{index}].tool_calls[{i}]") for i, c in enumerate(calls)]
        else:
            del msg["tool_calls"]
    reasoning = msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")
    if reasoning is not None:
        msg["reasoning"] = msg["reasoning_content"] = reasoning
