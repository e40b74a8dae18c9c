"""The ``X-Request-Id`` header: a client's id for its request (or a new one), returned in the response's header
and, for chat and completions, as the body's id (``chatcmpl-<id>``, ``cmpl-<id>``), as vLLM does: a request
can then be followed from the client through proxies and logs."""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpserve.server.errors import APIError

HEADER = b"x-request-id"
MAX_CHARS = 128
_VALID = re.compile(rf"[A-Za-z0-9._~:/+=-]{{1,{MAX_CHARS}}}")


class RequestIdHeader:
    """ASGI middleware: the request's id into ``request.state.request_id`` and the response's ``X-Request-Id``; a
    malformed one (over 128 characters, or characters a log line or header could be forged with) is a 400."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(HEADER)
        rid = given.decode("latin-1") if given is not None else uuid.uuid4().hex
        if given is not None and not _VALID.fullmatch(rid):
            message = f"X-Request-Id must be 1-{MAX_CHARS} characters of letters, digits and ._~:/+=-"
            return await APIError(400, message, param="X-Request-Id").response()(scope, receive, send)
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER, rid.encode("latin-1"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id(request: Request | None) -> str | None:
    """The id ``RequestIdHeader`` gave this request (None outside the app, e.g. in unit tests of a handler)."""
    return getattr(request.state, "request_id", None) if request is not None else None
