"""OpenAI's Responses API (``/v1/responses``) on top of the chat pipeline: the routes' work.

A request becomes a chat request (``responses_request``: its input items, with the stored history
of ``previous_response_id``, as chat messages) that runs through ``Serving`` as any other; its output
becomes output items and stream events (``response_output``). Stored responses live in the app
state's ``ResponseStore`` (``response_store``) from their start (a running one shows its output so
far); a background response runs in a task of that store, without a client, and keeps its stream
events there, for streams to (re)attach.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tpserve.message.frontend import TokenizeRequest
from tpserve.parsers.chat_output import ChatOutputConfig
from tpserve.server.conversation_store import ConversationStore, check_unique_ids
from tpserve.server.errors import APIError
from tpserve.server.pages import DEFAULT_LIMIT, page
from tpserve.server.protocol import ChatCompletionRequest
from tpserve.server.responses_protocol import ResponsesRequest
from tpserve.server.response_output import RESPONSES_PARAMS, ResponsesFormat, stored_item, with_responses_names
from tpserve.server.response_store import ResponseStore, StoredResponse, not_found
from tpserve.server.responses_request import chat_request, input_items
from tpserve.server.serving import Serving, sse
from tpserve.server.truncation import first_fitting, pinned, starts

logger = logging.getLogger(__name__)

TokenCounter = Callable[[TokenizeRequest], Awaitable[int]]  # a chat request's prompt tokens


def _history(store: ResponseStore, previous_response_id: str | None) -> list[dict[str, Any]]:
    if previous_response_id is None:
        return []
    entry = store.get(previous_response_id)
    if entry is None:  # OpenAI's code, which clients check to resend the whole conversation instead
        raise APIError(400, f"Previous response with id '{previous_response_id}' not found.",
                       param="previous_response_id", code="previous_response_not_found")
    if entry.running is not None:
        raise APIError.invalid(f"Previous response with id '{previous_response_id}' is still in progress.",
                               "previous_response_id")
    return entry.items


def referenced(store: ResponseStore, items: list[Any], param: str = "input") -> list[Any]:
    """The items (of ``param``), each ``item_reference`` replaced by the stored item it names (an
    input or output item of a stored response)."""
    resolved = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            item_id = item.get("id")
            item = store.item(item_id) if isinstance(item_id, str) else None
            if item is None:
                raise APIError.invalid(f"{param}[{i}]: item_reference: no stored item has id {item_id!r}", param)
        resolved.append(item)
    return resolved


def _prepare(serving: Serving, chat: ChatCompletionRequest) -> tuple[list[TokenizeRequest], ChatOutputConfig]:
    """The chat pipeline's requests; its errors (and the tokenizer's, later) name the Responses fields."""
    try:
        reqs, output, _ = serving.chat_requests(chat)
    except APIError as e:
        raise with_responses_names(e) from None
    renamed = [msgspec.structs.replace(r, structured_param=RESPONSES_PARAMS.get(r.structured_param, r.structured_param))
               for r in reqs]
    return renamed, output


async def _fitted(serving: Serving, body: ResponsesRequest, history: list[dict[str, Any]],
                  count: TokenCounter) -> tuple[list[TokenizeRequest], ChatOutputConfig]:
    """``truncation: "auto"``: the requests of the conversation from the first start (``truncation``)
    whose prompt, counted by ``count`` as the tokenizer worker renders it, leaves room in the context
    for ``max_output_tokens`` (else ``min_tokens``, at least one token); if none does, of the whole
    conversation (the tokenizer worker's usual 400)."""
    whole = chat_request(body, history)  # the items' errors, named as without truncation
    context = serving.limits.context_len
    fitting: dict[int, tuple[list[TokenizeRequest], ChatOutputConfig]] = {}

    async def fits(start: int) -> bool:
        try:  # a too-long prompt is a 400 of the character limit or of the chat template
            prepared = _prepare(serving, whole if start == 0 else chat_request(body, history, start))
            params = prepared[0][0].params
            room = params.max_tokens if params.max_tokens is not None else max(1, params.min_tokens)
            if await count(prepared[0][0]) + room > context:
                return False
        except APIError:
            return False
        fitting[start] = prepared
        return True

    items = history + input_items(body)
    start = await first_fitting(starts(items), fits)
    if start is None:
        return _prepare(serving, whole)
    if start:
        logger.debug("response input truncated: %d of %d items dropped", start - sum(map(pinned, items[:start])),
                     len(items))
    return fitting[start]


async def create_response(
    serving: Serving, store: ResponseStore, conversations: ConversationStore, body: ResponsesRequest, request: Request,
    count: TokenCounter | None = None,
) -> Response:
    """With ``store``, the response is stored as it starts (GET shows it in progress) and replaced
    by its final object; ``background`` answers at once (or streams the stored events, which a
    client leaving does not stop) and generates in a task of the store. With ``conversation``, its
    items come before the input, and the response holds it until it ends: completed (or incomplete),
    its input and output items are appended; failed, cancelled or left by its client, nothing is.
    ``count``: a chat prompt's tokens, for ``truncation: "auto"`` (which shortens the prompt only:
    the history stored with the response is whole)."""
    serving.check_model(body.model, generates=True)
    body.check()
    conversation = None if body.conversation_id is None else conversations.get(body.conversation_id, "conversation")
    if conversation is not None:
        conversation.check_unlocked()
        history = list(conversation.items.values())
    else:
        history = _history(store, body.previous_response_id)
    if isinstance(body.input, list):
        body = body.model_copy(update={"input": referenced(store, body.input)})
    if body.truncation == "auto":
        if count is None:
            raise RuntimeError('truncation "auto" needs a token counter')
        reqs, output = await _fitted(serving, body, history, count)
    else:
        reqs, output = _prepare(serving, chat_request(body, history))
    own_items = [stored_item(item) for item in input_items(body)]
    # an item already in the history (previous_response_id's or the conversation's) is a 400, as OpenAI's
    check_unique_ids(own_items, "input", {item["id"] for item in history})

    def save(response: dict[str, Any]) -> None:
        store.finish(StoredResponse(response, history + own_items + response["output"], own_items, events=fmt.log))
        if conversation is not None:
            done = response["status"] in ("completed", "incomplete")
            conversations.release(conversation.id, fmt.id, own_items + response["output"] if done else None)

    fmt = ResponsesFormat(serving.answering_model(body.model), body, output, save, reqs[0].params, serving.tokens_as_ids)
    release = partial(conversations.release, conversation.id, fmt.id) if conversation is not None else _nothing
    if conversation is not None:
        conversations.hold(conversation, fmt.id, own_items, history)
    if body.store:
        store.put(StoredResponse(fmt.snapshot(), [], own_items, running=fmt, events=fmt.log))
    if fmt.log is not None:
        fmt.queued()
        store.start(fmt.id, _generate(serving, reqs, fmt, release))
        return sse(fmt.log.follow()) if body.stream else JSONResponse(fmt.snapshot())

    def ended() -> None:  # without a final object (its client went away, an error): dropped
        store.drop_running(fmt.id)
        release()

    try:
        response = await serving.run(reqs, fmt, body.stream, request)
    except BaseException as e:  # the tokenizer's rejection (the prompt's tokens), a backend error, ...
        ended()
        if isinstance(e, APIError):
            with_responses_names(e)
        raise
    if isinstance(response, StreamingResponse):  # stored as its stream ends, or dropped if it stops short
        response.body_iterator = _then(response.body_iterator, ended)
    else:  # stored already, unless its client went away
        ended()
    return response


def _nothing() -> None:
    pass


async def _then(chunks: AsyncIterator[Any], last: Callable[[], None]) -> AsyncIterator[Any]:
    """``chunks``, then ``last()`` however they end."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        last()


async def _generate(serving: Serving, reqs: list[TokenizeRequest], fmt: ResponsesFormat,
                    release: Callable[[], None]) -> None:
    """A background response's generation: its stream, run to the end unread (``fmt`` keeps the
    output and the events; a cancel aborts the requests as a client leaving a stream does); then
    ``release()`` (its conversation, if it ended without a final object)."""
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
        release()
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
    if entry.events is None and entry.current()["background"]:
        raise APIError.invalid(f"The stream events of this response are no longer kept (only those of the latest "
                               f"{store.event_logs} finished background responses): GET it without stream", "stream")
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


def list_input_items(
    store: ResponseStore, response_id: str, after: str | None = None, before: str | None = None,
    limit: int = DEFAULT_LIMIT, order: str = "desc",
) -> dict[str, Any]:
    """A page of a stored response's input items, as OpenAI's cursor lists."""
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id)
    return page(entry.input_items, "this response's input", after, before, limit, order)
