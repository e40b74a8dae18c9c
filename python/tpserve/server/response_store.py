"""The Responses API's store: stored responses by id in a bounded LRU map (the app state's), their
items by id (for ``item_reference``), a background response's task and its stream events."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Coroutine

from tpserve.server.errors import APIError

if TYPE_CHECKING:
    from tpserve.server.response_output import ResponsesFormat

MAX_STORED_RESPONSES = 4096
# Finished background responses whose stream events are kept for GET ?stream=true (the latest finished): a log holds
# ~210 bytes a token (a delta event), ~50x its text, so 4096 long ones could hold GBs; 256 of 2,000 tokens ~110 MB.
MAX_EVENT_LOGS = 256

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

    def __init__(self, capacity: int = MAX_STORED_RESPONSES, event_logs: int = MAX_EVENT_LOGS) -> None:
        self.capacity, self.event_logs = capacity, event_logs
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._logged: OrderedDict[str, None] = OrderedDict()  # finished ones with their events, first finished first
        # item id -> the stored items with that id, latest last (a referenced item is stored again by the response
        # that references it: deleting that one must leave the first's)
        self._items: dict[str, list[dict[str, Any]]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def item(self, item_id: str) -> dict[str, Any] | None:
        stored = self._items.get(item_id)
        return stored[-1] if stored else None

    def put(self, entry: StoredResponse) -> None:
        self._remove(entry.response["id"])
        self._entries[entry.response["id"]] = entry
        for item in entry.own_items():
            self._items.setdefault(item["id"], []).append(item)
        while len(self._entries) > self.capacity:
            self._remove(next(iter(self._entries)))

    def finish(self, entry: StoredResponse) -> None:
        """Put ``entry``, the final object of a running response, unless it was deleted meanwhile. Beyond
        ``event_logs`` finished background responses, the first finished loses its events (streams that
        follow them keep theirs)."""
        response_id = entry.response["id"]
        if response_id not in self._entries:
            return
        self.put(entry)
        if entry.events is None:
            return
        self._logged[response_id] = None
        while len(self._logged) > self.event_logs:
            oldest, _ = self._logged.popitem(last=False)
            self._entries[oldest] = replace(self._entries[oldest], events=None)  # (keeps its place in the LRU)

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
        self._logged.pop(response_id, None)
        entry = self._entries.pop(response_id, None)
        for item in entry.own_items() if entry is not None else []:
            stored = self._items.get(item["id"], [])
            stored[:] = [other for other in stored if other is not item]
            if not stored:
                self._items.pop(item["id"], None)
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
