"""OpenAI's Conversations API (``/v1/conversations``): the routes' work. A conversation holds items
(as a stored response's: messages, function calls and their outputs, reasoning), which a response
created with ``conversation`` continues (``responses.create_response``). They live in the app
state's ``ConversationStore`` (``conversation_store``)."""

from __future__ import annotations

from typing import Any

from tpserve.server.conversation_store import ConversationStore
from tpserve.server.errors import APIError
from tpserve.server.pages import DEFAULT_LIMIT, item_list, page
from tpserve.server.responses_protocol import (
    ConversationCreateBody,
    ConversationItemsBody,
    ConversationUpdateBody,
    check_metadata,
)
from tpserve.server.response_output import stored_item
from tpserve.server.response_store import ResponseStore
from tpserve.server.responses import referenced
from tpserve.server.responses_request import check_items

MAX_ITEMS_ADDED = 20  # items a conversation gets in one call (OpenAI's bound)


def _stored_items(responses: ResponseStore, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items as a conversation keeps them (checked as a response's input is, each with an id);
    an ``item_reference`` is the stored item it names."""
    if len(items) > MAX_ITEMS_ADDED:
        raise APIError.invalid(f"items: at most {MAX_ITEMS_ADDED} items may be added at a time, got {len(items)}",
                               "items")
    items = referenced(responses, items, "items")
    check_items(items, "items")
    return [stored_item(item) for item in items]


def create_conversation(
    conversations: ConversationStore, responses: ResponseStore, body: ConversationCreateBody,
) -> dict[str, Any]:
    check_metadata(body.metadata)
    return conversations.create(body.metadata or {}, _stored_items(responses, body.items)).obj()


def update_conversation(conversations: ConversationStore, conversation_id: str,
                        body: ConversationUpdateBody) -> dict[str, Any]:
    check_metadata(body.metadata)
    conversation = conversations.get(conversation_id)
    conversation.metadata = body.metadata
    return conversation.obj()


def delete_conversation(conversations: ConversationStore, conversation_id: str) -> dict[str, Any]:
    conversations.delete(conversation_id)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


def add_items(
    conversations: ConversationStore, responses: ResponseStore, conversation_id: str, body: ConversationItemsBody,
) -> dict[str, Any]:
    """The items appended, as a list (all of them, in order)."""
    conversation = conversations.get(conversation_id)
    if not body.items:
        raise APIError.invalid("items must not be empty", "items")
    items = _stored_items(responses, body.items)
    conversation.check_new(items, "items", conversations.max_items)
    conversation.add(items)
    return item_list(items)


def list_items(
    conversations: ConversationStore, conversation_id: str, after: str | None = None, limit: int = DEFAULT_LIMIT,
    order: str = "desc",
) -> dict[str, Any]:
    items = list(conversations.get(conversation_id).items.values())
    return page(items, "this conversation", after, None, limit, order)


def get_item(conversations: ConversationStore, conversation_id: str, item_id: str) -> dict[str, Any]:
    return conversations.get(conversation_id).item(item_id)


def delete_item(conversations: ConversationStore, conversation_id: str, item_id: str) -> dict[str, Any]:
    """Remove an item (not while a response runs on the conversation); the conversation is the answer."""
    conversation = conversations.get(conversation_id)
    conversation.item(item_id)
    conversation.check_unlocked()
    del conversation.items[item_id]
    return conversation.obj()
