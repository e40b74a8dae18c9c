"""The Responses API's output: a chat output (split by the chat output parser into reasoning, content
and tool calls) as output items (``reasoning``, ``message`` with one ``output_text`` part,
``function_call``), whole or streamed as the semantic events (``response.output_text.delta``, ...)
numbered by ``sequence_number``; and the input items as they are stored."""

from __future__ import annotations

import itertools
import re
import uuid
from dataclasses import replace
from typing import Any, Callable, Iterable

import msgspec

from tpserve.message.frontend import ApiOutput, TokenLogprob
from tpserve.parsers.chat_output import ChatDelta, ChatOutputConfig, ChatOutputParser, ReasoningTokens
from tpserve.sampling_params import SamplingParams
from tpserve.server.errors import APIError
from tpserve.server.formats import Choice, ResponseFormat, chat_logprobs
from tpserve.server.responses_protocol import ResponsesRequest
from tpserve.server.response_store import EventLog
from tpserve.server.chat_messages import TEXT_PARTS

# a chat field named in an error -> the Responses field it came from
RESPONSES_PARAMS = {"response_format": "text.format", "messages": "input", "max_tokens": "max_output_tokens"}
# chat field names an error's message may use (``messages`` stays: its indexes count the chat's messages)
CHAT_NAMES_IN_MESSAGES = re.compile(r"\b(response_format|max_tokens)\b")
# an input item's type -> the prefix of the id it gets when the client gave none
ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


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
        # The open item's text (or arguments) since it was last brought up to date (``_flush``): added to it piece by
        # piece, the whole text so far was copied for every token, quadratic in a long output.
        self._pieces: list[str] = []
        self._call_index: int | None = None  # the parser's index of the open function call
        self.reasoning = ReasoningTokens()
        self._held: list[dict[str, Any]] = []  # log-probabilities of text the parser held back: they go with that text

    def add(
        self, delta: ChatDelta, tokens: int = 0, logprobs: list[dict[str, Any]] | None = None, reasoning: bool = False
    ) -> list[dict[str, Any]]:
        """``delta``: what ``tokens`` tokens, of log-probabilities ``logprobs``, were parsed into. Those of a
        ``reasoning`` piece (the think block, its tags, the newlines after it) count as reasoning tokens; the
        log-probabilities go with the message text (not the reasoning's, nor the tool calls')."""
        held, self._held = self._held + (logprobs or []), []
        self.reasoning.add(delta, tokens, reasoning)
        if reasoning:
            held = []
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
                self._pieces.append(call.arguments)
                events.append(_item_event(self._open, len(self.items) - 1, "response.function_call_arguments.delta",
                                          delta=call.arguments))
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the open item with ``status``; an output without items gets an empty message."""
        events = [] if self.items else self._start_text_item("message")
        return events + self.end(status)

    def so_far(self) -> list[dict[str, Any]]:
        """``items``, the open one's text brought up to date."""
        self._flush()
        return self.items

    def _flush(self) -> None:
        if not self._pieces or self._open is None:
            return
        written = "".join(self._pieces)
        self._pieces.clear()
        if self._open["type"] == "function_call":
            self._open["arguments"] += written
        else:
            self._open["content"][0]["text"] += written

    def end(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the open item, if any, with ``status``."""
        self._flush()
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
                                      logprobs=_event_logprobs(part["logprobs"]))]
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
        self._pieces.append(text)
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {}
        if kind == "message":
            part["logprobs"] += logprobs or []
            extra["logprobs"] = _event_logprobs(logprobs or [])
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
                                     part=_copy_part(part))]

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}]


def _event_logprobs(logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logprobs as the text events carry them: without ``bytes`` (OpenAI's ``response.output_text.delta``/``.done``
    logprobs, and vLLM's, are token, logprob and top_logprobs of token and logprob); the output_text part keeps them."""
    def shown(entry: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in entry.items() if k != "bytes"}

    return [{**shown(lp), "top_logprobs": [shown(t) for t in lp["top_logprobs"]]} if "top_logprobs" in lp else shown(lp)
            for lp in logprobs]


def _item_event(item: dict[str, Any], index: int, name: str, **fields: Any) -> dict[str, Any]:
    return {"type": name, "item_id": item["id"], "output_index": index, **fields}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as it stands: what ``OutputItems`` changes later (the item, its parts, a part's log-probabilities
    list) copied; the rest shared, as nothing changes it once made (the per-token log-probability entries, a long
    output's bulk: a JSON round trip copied those too, twice per response, each copy more work for the garbage
    collector to scan as long as the response lives)."""
    copied = dict(item)
    if "content" in item:
        copied["content"] = [_copy_part(part) for part in item["content"]]
    return copied


def _copy_part(part: dict[str, Any]) -> dict[str, Any]:
    copied = dict(part)
    if "logprobs" in part:
        copied["logprobs"] = list(part["logprobs"])
    return copied


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
                 on_done: Callable[[dict[str, Any]], None], params: SamplingParams, tokens_as_ids: bool = False) -> None:
        """``params``: the sampling parameters used (the model's defaults where the body sets none), as reported;
        ``tokens_as_ids``: logprobs name tokens "token_id:N" (--return-tokens-as-token-ids)."""
        super().__init__(model, logprobs=body.wants_logprobs, tokens_as_ids=tokens_as_ids)
        self.id = _new_id("resp")
        self.body = body
        self.params = params
        self.output = output
        self.on_done = on_done
        self._items = OutputItems()
        self._parser: ChatOutputParser | None = None
        self._finish_reason: str | None = None
        self._sequence = 0
        self._done: dict[str, Any] | None = None  # the final response object
        self.log = EventLog() if body.background else None

    # -- building --
    def _feed(
        self, text: str, tokens: int, prompt_in_reasoning: bool | None, finish_reason: str | None,
        logprobs: list[TokenLogprob] | None,
    ) -> list[dict[str, Any]]:
        if self._parser is None:
            self._parser = ChatOutputParser(replace(self.output, starts_in_reasoning=prompt_in_reasoning))
        delta = self._parser.feed(text, final=finish_reason is not None)
        events = self._items.add(delta, tokens, chat_logprobs(logprobs, self.tokens_as_ids) if self.logprobs else None,
                                 self._parser.is_reasoning(delta))
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
            "max_tool_calls": body.max_tool_calls,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": [_copy(item) for item in self._items.so_far()],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "prompt": None,
            "prompt_cache_key": body.prompt_cache_key,
            "conversation": None if body.conversation_id is None else {"id": body.conversation_id},
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "safety_identifier": body.safety_identifier,
            "service_tier": "default",  # the tier that served it: tpserve has one
            "store": body.store,
            "temperature": self.params.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice,
            "tools": body.tools,
            "top_p": self.params.top_p,
            "top_logprobs": body.top_logprobs,
            "truncation": body.truncation,
            "usage": None if usage is None else _usage(usage, self._items.reasoning.count),
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
        self._items.end("incomplete")  # the item the error cut short
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

    def queued(self) -> None:
        """A background response's first event, at once: its generation may be cancelled before any output."""
        self._events([{"type": "response.created", "response": self.snapshot()}])

    def start_chunk(self, index: int) -> bytes:
        response = self._response("in_progress", None)
        created = [] if self._sequence else [{"type": "response.created", "response": response}]
        return b"".join(self._events(created + [{"type": "response.in_progress", "response": response}]))

    def output_chunks(self, choice: Choice, out: ApiOutput) -> list[bytes]:
        return self._events(self._feed(out.text, out.new_tokens, out.prompt_in_reasoning, out.finish_reason,
                                       out.logprobs))

    def error_chunk(self, error: APIError) -> bytes:
        error = with_responses_names(error)
        cut = self._items.end("incomplete")  # the open item's last events, as for any item that ends
        failed = self.fail(error)
        return b"".join(self._events([
            *cut,
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


def with_responses_names(error: APIError) -> APIError:
    """``error`` naming the Responses field where it names a chat field."""
    error.param = RESPONSES_PARAMS.get(error.param or "", error.param)
    error.message = CHAT_NAMES_IN_MESSAGES.sub(lambda m: RESPONSES_PARAMS[m.group(1)], error.message)
    return error
