"""OpenAI's Responses API (``/v1/responses``) on top of the chat pipeline: the stored responses,
the output and the routes' work.

A request becomes a chat request (``responses_request``: its input items, with the stored history
of ``previous_response_id``, as chat messages) that runs through ``Serving`` as any other. Its output, split by the chat output parser into reasoning,
content and tool calls, becomes output items: ``reasoning``, ``message`` (one ``output_text``
part) and ``function_call``; streamed, as the semantic events (``response.output_text.delta``, ...)
numbered by ``sequence_number``. Stored responses live in a bounded LRU map in the app state,
from their start (a running one shows its output so far); a background response runs in a task
of that store, without a client, and keeps its stream events there, for streams to (re)attach.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, AsyncIterator, Callable, Coroutine, Iterable

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tpserve.message.frontend import ApiOutput, TokenizeRequest, TokenLogprob
from tpserve.parsers.chat_output import ChatDelta, ChatOutputConfig, ChatOutputParser
from tpserve.server.errors import APIError
from tpserve.server.formats import Choice, ResponseFormat, chat_logprobs
from tpserve.server.protocol import ChatCompletionRequest, ResponsesRequest
from tpserve.server.responses_request import TEXT_PARTS, chat_request, input_items
from tpserve.server.serving import Serving, sse

MAX_STORED_RESPONSES = 4096

# a chat field named in an error -> the Responses field it came from
RESPONSES_PARAMS = {"response_format": "text.format", "messages": "input", "max_tokens": "max_output_tokens"}
# chat field names an error's message may use (``messages`` stays: its indexes count the chat's messages)
CHAT_NAMES_IN_MESSAGES = re.compile(r"\b(response_format|max_tokens)\b")
# an input item's type -> the prefix of the id it gets when the client gave none
ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
INPUT_ITEMS_LIMIT = 20  # GET /v1/responses/{id}/input_items: the default page size (at most 100)

logger = logging.getLogger(__name__)


# ---- the store ----
class EventLog:
    """A background response's stream events (SSE chunks; the n-th is numbered n), which streams
    replay and then follow until the generation ends."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.ended = False
        self._changed = asyncio.Event()  # set (and replaced) on each change

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, starting_after: int = -1) -> AsyncIterator[bytes]:
        """The events numbered after ``starting_after``, as they come, until the generation ends."""
        sent = max(starting_after + 1, 0)
        while True:
            changed = self._changed
            if sent < len(self.chunks):
                batch, sent = b"".join(self.chunks[sent:]), len(self.chunks)
                yield batch
            elif self.ended:
                return
            else:
                await changed.wait()


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    # The conversation as Responses items: the previous response's, this input, this output. The
    # item dicts are shared with the previous entries, so a long chain costs one list of references each.
    items: list[dict[str, Any]]
    # This request's own input items as OpenAI lists them (each with an id): /input_items.
    input_items: list[dict[str, Any]] = field(default_factory=list)
    # While it is generated: the response so far (``response`` is then the one it started as).
    running: ResponsesFormat | None = None
    events: EventLog | None = None  # a background response's stream events

    def current(self) -> dict[str, Any]:
        return self.running.snapshot() if self.running is not None else self.response

    def own_items(self) -> list[dict[str, Any]]:
        """The items this response added (its input and output): what ``item_reference`` may name."""
        return self.input_items + self.response["output"]


class ResponseStore:
    """Stored responses by id, the least recently used dropped beyond ``capacity``; their items by
    id; and the tasks generating background responses."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._items: dict[str, dict[str, Any]] = {}  # item id -> the item (the latest stored with that id)
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def item(self, item_id: str) -> dict[str, Any] | None:
        return self._items.get(item_id)

    def put(self, entry: StoredResponse) -> None:
        self._remove(entry.response["id"])
        self._entries[entry.response["id"]] = entry
        self._items.update((item["id"], item) for item in entry.own_items())
        while len(self._entries) > self.capacity:
            self._remove(next(iter(self._entries)))

    def finish(self, entry: StoredResponse) -> None:
        """Put ``entry``, the final object of a running response, unless it was deleted meanwhile."""
        if entry.response["id"] in self._entries:
            self.put(entry)

    def drop_running(self, response_id: str) -> None:
        """Forget a response that stopped without a final object (its client went away)."""
        entry = self._entries.get(response_id)
        if entry is not None and entry.running is not None:
            self._remove(response_id)

    def delete(self, response_id: str) -> bool:
        task = self._tasks.get(response_id)
        if task is not None:
            task.cancel()
        return self._remove(response_id) is not None

    def _remove(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        for item in entry.own_items() if entry is not None else []:
            if self._items.get(item["id"]) is item:
                del self._items[item["id"]]
        return entry

    def start(self, response_id: str, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work``, a background response's generation, until it ends or ``cancel``."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks[response_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(response_id, None))

    async def cancel(self, response_id: str) -> None:
        """Stop a background response's generation (its requests are aborted) and wait for it."""
        task = self._tasks.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])


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
        self._held: list[dict[str, Any]] = []  # log-probabilities of the tokens of text the parser held back

    def add(self, delta: ChatDelta, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """``logprobs``: those of the tokens ``delta`` was parsed from. They go with the message text
        (those of reasoning or tool calls are left out; those of held-back text wait for it)."""
        held, self._held = self._held + (logprobs or []), []
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content, held)
        elif not delta:
            self._held = held
        for call in delta.tool_calls:
            if call.id is not None:
                events += self.end() + self._start({
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
        return events + self.end(status)

    def end(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the open item, if any, with ``status``."""
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
                                      logprobs=part["logprobs"])]
            else:
                events = [_item_event(item, index, "response.reasoning_text.done", content_index=0, text=part["text"])]
            events.append(_item_event(item, index, "response.content_part.done", content_index=0, part=dict(part)))
        return events + [{"type": "response.output_item.done", "output_index": index, "item": _copy(item)}]

    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self.end() + self._start_text_item(kind)
        item = self._open
        part = item["content"][0]  # type: ignore[index]
        part["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {}
        if kind == "message":
            part["logprobs"] += logprobs or []
            extra["logprobs"] = logprobs or []
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
                                     part=_copy(part))]

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
    finished response object (completed, incomplete, failed or cancelled), to store it."""

    object_name = "response"
    id_prefix = "resp"

    def __init__(self, model: str, body: ResponsesRequest, output: ChatOutputConfig,
                 on_done: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(model, logprobs=body.wants_logprobs)
        self.id = _new_id("resp")
        self.body = body
        self.output = output
        self.on_done = on_done
        self._items = OutputItems()
        self._parser: ChatOutputParser | None = None
        self._reasoning_tokens = 0
        self._finish_reason: str | None = None
        self._sequence = 0
        self._done: dict[str, Any] | None = None  # the final response object
        self.log = EventLog() if body.background else None

    # -- building --
    def _feed(
        self, text: str, tokens: int, prompt_in_reasoning: bool, finish_reason: str | None,
        logprobs: list[TokenLogprob] | None,
    ) -> list[dict[str, Any]]:
        if self._parser is None:
            self._parser = ChatOutputParser(replace(self.output, starts_in_reasoning=prompt_in_reasoning))
        delta = self._parser.feed(text, final=finish_reason is not None)
        if delta.reasoning:  # a piece that ends the reasoning counts as reasoning
            self._reasoning_tokens += tokens
        events = self._items.add(delta, chat_logprobs(logprobs) if self.logprobs else None)
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
            "background": body.background,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": _copy(self._items.items),
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": body.store,
            "temperature": body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice,
            "tools": body.tools,
            "top_p": body.top_p,
            "top_logprobs": body.top_logprobs,
            "truncation": body.truncation,
            "usage": None if usage is None else _usage(usage, self._reasoning_tokens),
            "user": body.user,
        }

    def snapshot(self) -> dict[str, Any]:
        """The response as it stands: the final one, or the output so far (a background response
        is "queued" until its first output)."""
        if self._done is not None:
            return self._done
        started = self._parser is not None or not self.body.background
        return self._response("in_progress" if started else "queued", None)

    def _finish(self, response: dict[str, Any]) -> dict[str, Any]:
        self._done = response
        self.on_done(response)
        return response

    def _final(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._finish(self._response("incomplete" if self._finish_reason == "length" else "completed", usage))

    def fail(self, error: APIError) -> dict[str, Any]:
        code = "invalid_prompt" if error.status < 500 else "server_error"  # the codes a failed response may have
        return self._finish({**self._response("failed", None), "error": {"code": code, "message": error.message}})

    def cancel(self) -> dict[str, Any]:
        """The response cancelled with the output so far (the final one, if it ended first)."""
        if self._done is not None:
            return self._done
        self._items.end("incomplete")
        return self._finish(self._response("cancelled", None))

    # -- whole --
    def response(self, choices: Iterable[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        (choice,) = choices
        starts = itertools.accumulate(choice.text_tokens, initial=0)  # each piece's first token
        pieces = list(zip(choice.text, choice.text_tokens, starts)) or [("", 0, 0)]
        for i, (text, tokens, start) in enumerate(pieces):
            finish_reason = choice.finish_reason if i == len(pieces) - 1 else None
            self._feed(text, tokens, choice.prompt_in_reasoning, finish_reason, choice.logprobs[start:start + tokens])
        return self._final(usage)

    # -- streamed --
    def _events(self, events: list[dict[str, Any]]) -> list[bytes]:
        chunks = []
        for event in events:
            chunks.append(_event_bytes({**event, "sequence_number": self._sequence}))
            self._sequence += 1
            if self.log is not None:
                self.log.add(chunks[-1])
        return chunks

    def start_chunk(self, index: int) -> bytes:
        response = self._response("in_progress", None)
        return b"".join(self._events([{"type": "response.created", "response": response},
                                      {"type": "response.in_progress", "response": response}]))

    def output_chunks(self, choice: Choice, out: ApiOutput) -> list[bytes]:
        return self._events(self._feed(out.text, out.new_tokens, out.prompt_in_reasoning, out.finish_reason,
                                       out.logprobs))

    def error_chunk(self, error: APIError) -> bytes:
        error = _renamed(error)
        failed = self.fail(error)
        return b"".join(self._events([
            {"type": "error", "code": error.code, "message": error.message, "param": error.param},
            {"type": "response.failed", "response": failed},
        ]))

    def failed_chunk(self, error: APIError) -> bytes:
        """``error_chunk``, after the stream's first events if it had not begun."""
        return (self.start_chunk(0) if self._sequence == 0 else b"") + self.error_chunk(error)

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
    if entry.running is not None:
        raise APIError.invalid(f"Previous response with id '{previous_response_id}' is still in progress.",
                               "previous_response_id")
    return entry.items


def _referenced(store: ResponseStore, items: list[Any]) -> list[Any]:
    """The input items, each ``item_reference`` replaced by the stored item it names (an input or
    output item of a stored response)."""
    resolved = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            item_id = item.get("id")
            item = store.item(item_id) if isinstance(item_id, str) else None
            if item is None:
                raise APIError.invalid(f"input[{i}]: item_reference: no stored item has id {item_id!r}", "input")
        resolved.append(item)
    return resolved


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
    """With ``store``, the response is stored as it starts (GET shows it in progress) and replaced
    by its final object; ``background`` answers at once (or streams the stored events, which a
    client leaving does not stop) and generates in a task of the store."""
    serving.check_model(body.model)
    body.check()
    history = _history(store, body.previous_response_id)
    if isinstance(body.input, list):
        body = body.model_copy(update={"input": _referenced(store, body.input)})
    reqs, output = _prepare(serving, chat_request(body, history))
    own_items = [stored_item(item) for item in input_items(body)]

    def save(response: dict[str, Any]) -> None:
        store.finish(StoredResponse(response, history + own_items + response["output"], own_items, events=fmt.log))

    fmt = ResponsesFormat(serving.model_name, body, output, save)
    if body.store:
        store.put(StoredResponse(fmt.snapshot(), [], own_items, running=fmt, events=fmt.log))
    if fmt.log is not None:
        store.start(fmt.id, _generate(serving, reqs, fmt))
        return sse(fmt.log.follow()) if body.stream else JSONResponse(fmt.snapshot())
    try:
        response = await serving.run(reqs, fmt, body.stream, request)
    except BaseException as e:  # the tokenizer's rejection (the prompt's tokens), a backend error, ...
        store.drop_running(fmt.id)
        if isinstance(e, APIError):
            _renamed(e)
        raise
    if isinstance(response, StreamingResponse):  # stored as its stream ends, or dropped if it stops short
        response.body_iterator = _then(response.body_iterator, partial(store.drop_running, fmt.id))
    else:  # stored already, unless its client went away
        store.drop_running(fmt.id)
    return response


async def _then(chunks: AsyncIterator[Any], last: Callable[[], None]) -> AsyncIterator[Any]:
    """``chunks``, then ``last()`` however they end."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        last()


async def _generate(serving: Serving, reqs: list[TokenizeRequest], fmt: ResponsesFormat) -> None:
    """A background response's generation: its stream, run to the end unread (``fmt`` keeps the
    output and the events; a cancel aborts the requests as a client leaving a stream does)."""
    try:
        response = await serving.run(reqs, fmt, True, None)
        if isinstance(response, StreamingResponse):
            async for _ in response.body_iterator:
                pass
    except APIError as e:  # the tokenizer's rejection, a backend error before the first token
        fmt.failed_chunk(e)
    except Exception as e:
        logger.exception("background response %s failed", fmt.id)
        fmt.failed_chunk(APIError(500, f"internal server error: {e}", type="server_error"))
    finally:
        if fmt.log is not None:
            fmt.log.end()


def get_response(
    store: ResponseStore, response_id: str, stream: bool = False, starting_after: int | None = None,
) -> dict[str, Any] | Response:
    """The stored response; with ``stream``, a background one's events after ``starting_after``,
    then the rest as they come."""
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id)
    if not stream:
        return entry.current()
    if entry.events is None:
        raise APIError.invalid("This response cannot be streamed because it was not created with background=true.",
                               "stream")
    return sse(entry.events.follow(-1 if starting_after is None else starting_after))


async def cancel_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    """Cancel a background response: a running one's requests are aborted; one cancelled already is
    returned as it is (as OpenAI does); any other is a 400."""
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id)
    response = entry.current()
    if not response["background"]:
        raise APIError.invalid("Only responses created with background: true can be cancelled.", "response_id")
    if entry.running is not None:
        await store.cancel(response_id)
        return entry.running.cancel()
    if response["status"] != "cancelled":
        raise APIError.invalid(f"Cannot cancel a response that is {response['status']}.", "response_id")
    return response


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
