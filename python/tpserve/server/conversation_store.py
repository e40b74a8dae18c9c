"""The Conversations API's store: conversations by id in a bounded LRU map (the app state's), each
with its metadata and its items in order; and the response that runs on a conversation, if any
(one at a time: its input and output items are appended as it completes)."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tpserve.server.errors import APIError

# Conversations kept in the API server's memory, the least recently used dropped first. A conversation's
# items are bounded too (a prompt cannot hold more anyway): at most MAX_CONVERSATION_ITEMS, plus the output
# of the response that reached it.
MAX_CONVERSATIONS = 1024
MAX_CONVERSATION_ITEMS = 4096


def check_unique_ids(items: list[dict[str, Any]], param: str, seen: set[str] | None = None) -> set[str]:
    """400 (OpenAI's message) if an item's id is in ``seen`` or comes twice; the ids, ``seen``'s included."""
    seen = set() if seen is None else seen
    for item in items:
        if item["id"] in seen:
            raise APIError.invalid(f"Duplicate item found with id {item['id']}. Remove duplicate items from "
                                   "your input and try again.", param)
        seen.add(item["id"])
    return seen


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: dict[str, dict[str, Any]] = field(default_factory=dict)  # item id -> the item, in order
    running: str | None = None  # the id of the response running on it (which holds it)

    def obj(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}

    def item(self, item_id: str) -> dict[str, Any]:
        item = self.items.get(item_id)
        if item is None:
            raise APIError(404, f"Item with id '{item_id}' not found.", param="item_id", code="not_found")
        return item

    def check_new(self, items: list[dict[str, Any]], param: str, capacity: int) -> None:
        """400 unless ``items`` (stored items, with ids) may be added: no id twice (OpenAI's message),
        no response running on it, no more than ``capacity`` items in all."""
        self.check_unlocked()
        seen = check_unique_ids(items, param, set(self.items))
        if len(seen) > capacity:
            raise APIError.invalid(f"conversation {self.id} would hold {len(seen)} items; at most {capacity} are "
                                   "kept: delete items or start a new conversation", param)

    def check_unlocked(self) -> None:
        """400 while a response runs on the conversation (its items would land in the wrong order)."""
        if self.running is not None:
            raise APIError(400, "Another process is currently operating on this conversation (response "
                           f"{self.running}). Please retry once it ends.", param="conversation",
                           code="conversation_locked")

    def add(self, items: list[dict[str, Any]]) -> None:
        self.items.update((item["id"], item) for item in items)


class ConversationStore:
    """Conversations by id, the least recently used dropped beyond ``capacity``; each holds at most
    ``max_items`` items (a response appends its output past that)."""

    def __init__(self, capacity: int = MAX_CONVERSATIONS, max_items: int = MAX_CONVERSATION_ITEMS) -> None:
        self.capacity, self.max_items = capacity, max_items
        self._entries: OrderedDict[str, Conversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def create(self, metadata: dict[str, str], items: list[dict[str, Any]]) -> Conversation:
        conversation = Conversation(f"conv_{uuid.uuid4().hex}", int(time.time()), metadata)
        conversation.check_new(items, "items", self.max_items)
        conversation.add(items)
        self._entries[conversation.id] = conversation
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return conversation

    def get(self, conversation_id: str, param: str = "conversation_id") -> Conversation:
        """The conversation (now the most recently used); unknown: a 404 naming ``param``."""
        conversation = self._entries.get(conversation_id)
        if conversation is None:
            raise APIError(404, f"Conversation with id '{conversation_id}' not found.", param=param,
                           code="not_found")
        self._entries.move_to_end(conversation_id)
        return conversation

    def delete(self, conversation_id: str) -> None:
        if self._entries.pop(conversation_id, None) is None:
            raise APIError(404, f"Conversation with id '{conversation_id}' not found.", param="conversation_id",
                           code="not_found")

    def hold(
        self, conversation: Conversation, response_id: str, items: list[dict[str, Any]], history: list[dict[str, Any]]
    ) -> None:
        """Let the response ``response_id``, whose input is ``items``, run on ``conversation`` (400 if
        another runs on it, or its items cannot be added; 404 if it is gone). ``history``: its items as
        the response read them, which must still be all of them (``truncation: "auto"`` awaits between)."""
        if self._entries.get(conversation.id) is not conversation:
            raise APIError(404, f"Conversation with id '{conversation.id}' not found.", param="conversation",
                           code="not_found")
        conversation.check_unlocked()
        if list(conversation.items) != [item["id"] for item in history]:
            raise APIError(400, "The conversation changed while this response's input was being prepared. "
                           "Please retry.", param="conversation", code="conversation_locked")
        conversation.check_new(items, "input", self.max_items)
        conversation.running = response_id

    def release(self, conversation_id: str, response_id: str, items: list[dict[str, Any]] | None = None) -> None:
        """The response ``response_id`` ended: ``items`` (its input and output, when it completed) are
        appended, unless the conversation is gone. Only the first call for a response counts."""
        conversation = self._entries.get(conversation_id)
        if conversation is None or conversation.running != response_id:
            return
        conversation.running = None
        conversation.add(items or [])
