"""``truncation: "auto"`` of the Responses API: the conversation (the stored history, then the
request's input items) loses items from its beginning until its prompt leaves room for the answer.

Items go whole, oldest first, but never a system or developer message (the instructions are no item:
they always stay), never a function_call whose function_call_output stays (a cut between them is no
candidate), never the last item. Which start fits is found by bisection over the candidate starts
(``first_fitting``), each rendered and counted as the tokenizer worker will; only what the model
sees is shortened: the stored response keeps every item, as OpenAI's does.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

PINNED_ROLES = ("system", "developer")


def pinned(item: Any) -> bool:
    """A system or developer message: never dropped."""
    return isinstance(item, dict) and item.get("type", "message") == "message" and item.get("role") in PINNED_ROLES


def kept(items: list[Any], start: int) -> list[Any]:
    """The conversation from ``items[start]`` on, after the pinned items before it."""
    return [item for item in items[:start] if pinned(item)] + items[start:]


def starts(items: list[Any]) -> list[int]:
    """The indexes the conversation may start at, 0 first: each cut keeps every function_call with
    its outputs and the last item, and differs from the cut before it (a pinned item is no cut)."""
    calls: dict[str, int] = {}
    blocked_until = [-1] * (len(items) + 1)  # a cut at k in [call + 1, output] separates them
    for i, item in enumerate(items):
        kind, call_id = (item.get("type"), item.get("call_id")) if isinstance(item, dict) else (None, None)
        if kind == "function_call":
            calls.setdefault(call_id, i)
        elif kind == "function_call_output" and call_id in calls:
            first = calls[call_id] + 1
            blocked_until[first] = max(blocked_until[first], i)
    cuts, reach = [0], -1
    for k in range(1, len(items)):
        reach = max(reach, blocked_until[k])
        if reach < k and not pinned(items[k - 1]):
            cuts.append(k)
    return cuts


async def first_fitting(cuts: list[int], fits: Callable[[int], Awaitable[bool]]) -> int | None:
    """The first of ``cuts`` that ``fits``, or None: the first cut, then a bisection of the others
    (a later start is taken to fit if an earlier one does), so at most 1 + ceil(log2(len(cuts)))
    calls; the answer is always a cut that ``fits`` said fits."""
    if await fits(cuts[0]):
        return cuts[0]
    lo, hi = 1, len(cuts)
    while lo < hi:
        mid = (lo + hi) // 2
        if await fits(cuts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return cuts[lo] if lo < len(cuts) else None
