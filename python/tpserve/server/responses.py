"""OpenAI's Responses API (``/v1/responses``) on top of the chat pipeline: the stored responses,
the output and the routes' work.

A request becomes a chat request (``responses_request``: its input items, with the stored history
of ``previous_response_id``, as chat messages) that runs through ``Serving`` as any other. Its output, split by the chat output parser into reasoning,
content and tool calls, becomes output items: ``reasoning``, ``message`` (one ``output_text``
part) and ``function_call``; streamed, as the semantic events (``response.output_text.delta``, ...)
numbered by ``sequence_number``. Stored responses live in a bounded LRU map in the app state.
"""

from __future__ import annotations

import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import msgspec
from fastapi import Request
from fastapi.responses import Response

from tpserve.message.frontend import ApiOutput, TokenizeRequest
from tpserve.parsers.chat_output import ChatDelta, ChatOutputConfig, ChatOutputParser
from tpserve.server.errors import APIError
from tpserve.server.formats import Choice, ResponseFormat
from tpserve.server.protocol import ChatCompletionRequest, ResponsesRequest
from tpserve.server.responses_request import TEXT_PARTS, chat_request, input_items
from tpserve.server.serving import Serving

MAX_STORED_RESPONSES = 4096

# a chat field named in an error -> the Responses field it came from
RESPONSES_PARAMS = {"response_format": "text.format", "messages": "input", "max_tokens": "max_output_tokens"}
# chat field names an error's message may use (``messages`` stays: its indexes count the chat's messages)
CHAT_NAMES_IN_MESSAGES = re.compile(r"\b(response_format|max_tokens)\b")
# an input item's type -> the prefix of the id it gets when the client gave none
ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
INPUT_ITEMS_LIMIT = 20  # GET /v1/responses/{id}/input_items: the default page size (at most 100)


# ---- the store ----
@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    # The conversation as Responses items: the previous response's, this input, this output. The
    # item dicts are shared with the previous entries, so a long chain costs one list of references each.
    items: list[dict[str, Any]]
    # This request's own input items as OpenAI lists them (each with an id): /input_items.
    input_items: list[dict[str, Any]] = field(default_factory=list)


class ResponseStore:
    """Stored responses by id, the least recently used dropped beyond ``capacity``."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response["id"]] = entry
        self._entries.move_to_end(entry.response["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


# ---- input: Responses items -> chat messages ----


def _stored_part(part: Any, role: str) -> Any:
    """A message's content part as OpenAI lists it: text as ``input_text`` (``output_text`` for
    the assistant, with its annotations); other parts (a refusal) as given."""
    if isinstance(part, dict) and part.get("type") not in TEXT_PARTS:
        return part
    text = part if isinstance(part, str) else part["text"]
    return _text_part(text) if role == "assistant" else {"type": "input_text", "text": text}


def stored_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item (already checked by ``chat_messages``) as a stored item: with its type, an id
    (the client's, or a new one), a status, and a message's content as a list of parts."""
    kind = item.get("type", "message")
    item_id = item.get("id")
    stored = {k: v for k, v in item.items() if v is not None}  # null: not given, as in a request body
    stored.update(type=kind, id=item_id if isinstance(item_id, str) and item_id else _new_id(ITEM_ID_PREFIXES[kind]))
    stored.setdefault("status", "completed")
    if kind == "message":
        content = item["content"]
        parts = [content] if isinstance(content, str) else content
        stored["content"] = [_stored_part(p, item["role"]) for p in parts]
    elif kind == "reasoning":
        stored.setdefault("summary", [])
    return stored


# ---- request: the rest of the fields ----


# ---- output: items and stream events ----
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputItems:
    """A response's output items, built from the parsed output as it arrives; every change also
    returns its stream events (without ``sequence_number``)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written (the last of ``items``)
        self._call_index: int | None = None  # the parser's index of the open function call

    def add(self, delta: ChatDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls:
            if call.id is not None:
                events += self._end() + self._start({
                    "id": _new_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name or "",
                    "arguments": "", "status": "in_progress"})
                self._call_index = call.index
            if call.arguments and self._open is not None and call.index == self._call_index:
                self._open["arguments"] += call.arguments
                events.append(_item_event(self._open, len(self.items) - 1, "response.function_call_arguments.delta",
                                          delta=call.arguments))
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the open item with ``status``; an output without items gets an empty message."""
        events = [] if self.items else self._start_text_item("message")
        return events + self._end(status)

    def _end(self, status: str = "completed") -> list[dict[str, Any]]:
        item, index = self._open, len(self.items) - 1
        if item is None:
            return []
        self._open = self._call_index = None
        item["status"] = status
        if item["type"] == "function_call":
            events = [_item_event(item, index, "response.function_call_arguments.done", arguments=item["arguments"])]
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events = [_item_event(item, index, "response.output_text.done", content_index=0, text=part["text"],
                                      logprobs=[])]
            else:
                events = [_item_event(item, index, "response.reasoning_text.done", content_index=0, text=part["text"])]
            events.append(_item_event(item, index, "response.content_part.done", content_index=0, part=dict(part)))
        return events + [{"type": "response.output_item.done", "output_index": index, "item": _copy(item)}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._end() + self._start_text_item(kind)
        item = self._open
        item["content"][0]["text"] += text  # type: ignore[index]
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [_item_event(item, len(self.items) - 1, name, content_index=0, delta=text, **extra)]

    def _start_text_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item: dict[str, Any] = {"id": _new_id("msg"), "type": "message", "role": "assistant",
                                    "status": "in_progress", "content": []}
            part = _text_part("")
        else:
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        events = self._start(item)
        item["content"].append(part)
        return events + [_item_event(item, len(self.items) - 1, "response.content_part.added", content_index=0,
                                     part=dict(part))]

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}]


def _item_event(item: dict[str, Any], index: int, name: str, **fields: Any) -> dict[str, Any]:
    return {"type": name, "item_id": item["id"], "output_index": index, **fields}


def _copy(obj: Any) -> Any:
    return msgspec.json.decode(msgspec.json.encode(obj))


def _event_bytes(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


def _usage(usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        # cache_write_tokens: OpenAI's billed cache writes (the SDK's model requires it); tpserve bills none
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                 "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage["total_tokens"],
    }


class ResponsesFormat(ResponseFormat):
    """One response (a single choice), whole or as its stream of events; ``on_done`` gets the
    finished response object (to store it)."""

    object_name = "response"
    id_prefix = "resp"

    def __init__(self, model: str, body: ResponsesRequest, output: ChatOutputConfig,
                 on_done: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(model)
        self.id = _new_id("resp")
        self.body = body
        self.output = output
        self.on_done = on_done
        self._items = OutputItems()
        self._parser: ChatOutputParser | None = None
        self._reasoning_tokens = 0
        self._finish_reason: str | None = None
        self._sequence = 0

    # -- building --
    def _feed(
        self, text: str, tokens: int, prompt_in_reasoning: bool, finish_reason: str | None
    ) -> list[dict[str, Any]]:
        if self._parser is None:
            self._parser = ChatOutputParser(replace(self.output, starts_in_reasoning=prompt_in_reasoning))
        delta = self._parser.feed(text, final=finish_reason is not None)
        if delta.reasoning:  # a piece that ends the reasoning counts as reasoning
            self._reasoning_tokens += tokens
        events = self._items.add(delta)
        if finish_reason is not None:
            self._finish_reason = finish_reason
            events += self._items.close("incomplete" if finish_reason == "length" else "completed")
        return events

    def _response(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        body = self.body
        reasoning = body.reasoning or {}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": _copy(self._items.items) if status != "in_progress" else [],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": body.store,
            "temperature": body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice,
            "tools": body.tools,
            "top_p": body.top_p,
            "truncation": body.truncation,
            "usage": None if usage is None else _usage(usage, self._reasoning_tokens),
            "user": body.user,
        }

    def _final(self, usage: dict[str, Any]) -> dict[str, Any]:
        status = "incomplete" if self._finish_reason == "length" else "completed"
        response = self._response(status, usage)
        self.on_done(response)
        return response

    # -- whole --
    def response(self, choices: Iterable[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        (choice,) = choices
        pieces = list(zip(choice.text, choice.text_tokens)) or [("", 0)]
        for i, (text, tokens) in enumerate(pieces):
            self._feed(text, tokens, choice.prompt_in_reasoning, choice.finish_reason if i == len(pieces) - 1 else None)
        return self._final(usage)

    # -- streamed --
    def _events(self, events: list[dict[str, Any]]) -> list[bytes]:
        chunks = []
        for event in events:
            chunks.append(_event_bytes({**event, "sequence_number": self._sequence}))
            self._sequence += 1
        return chunks

    def start_chunk(self, index: int) -> bytes:
        response = self._response("in_progress", None)
        return b"".join(self._events([{"type": "response.created", "response": response},
                                      {"type": "response.in_progress", "response": response}]))

    def output_chunks(self, choice: Choice, out: ApiOutput) -> list[bytes]:
        return self._events(self._feed(out.text, out.new_tokens, out.prompt_in_reasoning, out.finish_reason))

    def error_chunk(self, error: APIError) -> bytes:
        error = _renamed(error)
        code = "invalid_prompt" if error.status < 500 else "server_error"  # the codes a failed response may have
        failed = {**self._response("failed", None), "error": {"code": code, "message": error.message}}
        return b"".join(self._events([
            {"type": "error", "code": error.code, "message": error.message, "param": error.param},
            {"type": "response.failed", "response": failed},
        ]))

    def end_chunks(self, usage: dict[str, Any], failed: bool) -> list[bytes]:
        if failed:
            return []
        response = self._final(usage)
        name = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._events([{"type": name, "response": response}])


# ---- the routes' work ----
def _history(store: ResponseStore, previous_response_id: str | None) -> list[dict[str, Any]]:
    if previous_response_id is None:
        return []
    entry = store.get(previous_response_id)
    if entry is None:
        raise APIError.invalid(f"Previous response with id '{previous_response_id}' not found.", "previous_response_id")
    return entry.items


def _renamed(error: APIError) -> APIError:
    """``error`` naming the Responses field where it names a chat field."""
    error.param = RESPONSES_PARAMS.get(error.param or "", error.param)
    error.message = CHAT_NAMES_IN_MESSAGES.sub(lambda m: RESPONSES_PARAMS[m.group(1)], error.message)
    return error


def _prepare(serving: Serving, chat: ChatCompletionRequest) -> tuple[list[TokenizeRequest], ChatOutputConfig]:
    """The chat pipeline's requests; its errors (and the tokenizer's, later) name the Responses fields."""
    try:
        reqs, output, _ = serving.chat_requests(chat)
    except APIError as e:
        raise _renamed(e) from None
    renamed = [msgspec.structs.replace(r, structured_param=RESPONSES_PARAMS.get(r.structured_param, r.structured_param))
               for r in reqs]
    return renamed, output


async def create_response(serving: Serving, store: ResponseStore, body: ResponsesRequest, request: Request) -> Response:
    serving.check_model(body.model)
    body.check()
    history = _history(store, body.previous_response_id)
    reqs, output = _prepare(serving, chat_request(body, history))
    own_items = [stored_item(item) for item in input_items(body)]

    def save(response: dict[str, Any]) -> None:
        if body.store:
            store.put(StoredResponse(response, history + own_items + response["output"], own_items))

    fmt = ResponsesFormat(serving.model_name, body, output, save)
    try:
        return await serving.run(reqs, fmt, body.stream, request)
    except APIError as e:  # the tokenizer's rejection (the prompt's tokens), a backend error
        raise _renamed(e) from None


def get_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id)
    return entry.response


def delete_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    if not store.delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _cursor(items: list[dict[str, Any]], item_id: str, param: str) -> int:
    for i, item in enumerate(items):
        if item["id"] == item_id:
            return i
    raise APIError.invalid(f"{param}: this response has no input item with id '{item_id}'", param)


def list_input_items(
    store: ResponseStore, response_id: str, after: str | None = None, before: str | None = None,
    limit: int = INPUT_ITEMS_LIMIT, order: str = "desc",
) -> dict[str, Any]:
    """A page of a stored response's input items, as OpenAI's cursor lists: in ``order``, the
    ``limit`` items after the item ``after`` (or, given only ``before``, the ones just before it)."""
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id)
    items = entry.input_items if order == "asc" else entry.input_items[::-1]
    start = _cursor(items, after, "after") + 1 if after is not None else 0
    end = _cursor(items, before, "before") if before is not None else len(items)
    window = items[start:end]
    page = window[-limit:] if before is not None and after is None else window[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(window) > len(page),
    }
