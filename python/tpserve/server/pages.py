"""OpenAI's cursor lists (``{"object": "list", "data", "first_id", "last_id", "has_more"}``), as
``/v1/responses/{id}/input_items`` and ``/v1/conversations/{id}/items`` page their items."""

from __future__ import annotations

from typing import Any

from tpserve.server.errors import APIError

DEFAULT_LIMIT = 20  # the default page size (at most 100)


def _cursor(items: list[dict[str, Any]], item_id: str, param: str, owner: str) -> int:
    for i, item in enumerate(items):
        if item["id"] == item_id:
            return i
    raise APIError.invalid(f"{param}: {owner} has no item with id '{item_id}'", param)


def item_list(data: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def page(
    items: list[dict[str, Any]], owner: str, after: str | None = None, before: str | None = None,
    limit: int = DEFAULT_LIMIT, order: str = "desc",
) -> dict[str, Any]:
    """A page of ``items`` (oldest first): in ``order``, the ``limit`` items after the item
    ``after`` (or, given only ``before``, the ones just before it). An unknown cursor is a 400
    naming its parameter and ``owner`` ("this response")."""
    items = items if order == "asc" else items[::-1]
    start = _cursor(items, after, "after", owner) + 1 if after is not None else 0
    end = _cursor(items, before, "before", owner) if before is not None else len(items)
    window = items[start:end]
    data = window[-limit:] if before is not None and after is None else window[:limit]
    return item_list(data, len(window) > len(data))
