"""Errors as OpenAI-style bodies: FastAPI's validation errors as one 400 message naming the parameter,
unreadable bodies, anything unexpected as a 500; and JSON as the default body type."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tpserve.server.errors import APIError, error_body

logger = logging.getLogger(__name__)


def _body_problem(err: dict[str, Any]) -> str:
    """What is wrong with a body that is no JSON object at all (an error located at the body)."""
    if err.get("type") == "missing":
        return "the request body is empty: send a JSON object"
    if isinstance(err.get("input"), bytes):  # not parsed: a Content-Type other than JSON
        return "the request body must be a JSON object sent with Content-Type: application/json"
    return "the request body must be a JSON object"


# pydantic's names of union members (in an error's location) -> what a client reads
_UNION_MEMBERS = {
    "str": "a string", "int": "an integer", "list[str]": "a list of strings", "list[int]": "a list of token ids",
    "list[list[int]]": "a list of token-id lists", "list[any]": "a list", "dict[str,any]": "an object",
    "list[dict[str,any]]": "a list of objects",
}


def _union_member(loc: list[str]) -> tuple[list[str], str | None]:
    """(the field's location, the union member the error is about, or None): pydantic puts the
    member's type after the field (``prompt.list[int].0``)."""
    for i, part in enumerate(loc):
        if part in _UNION_MEMBERS or "[" in part:
            return loc[:i], _UNION_MEMBERS.get(part, part)
    return loc, None


def _one_of(options: list[str]) -> str:
    return options[0] if len(options) == 1 else f"{', '.join(options[:-1])} or {options[-1]}"


def _field_location(err: dict[str, Any]) -> list[Any]:
    """An error's location without where the field came from (``body``, a ``query`` parameter)."""
    loc = list(err.get("loc", ()))
    return loc[1:] if loc and loc[0] in ("body", "query") else loc


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts: list[str] = []
    param = None
    unions: dict[str, list[str]] = {}  # a field matching no member of its union -> the members
    for err in exc.errors():
        loc, member = _union_member([str(x) for x in _field_location(err)])
        where = ".".join(loc)
        if err.get("type") == "json_invalid":  # its loc is a character position, not a parameter
            at = f" at character {where}" if where else ""
            parts.append(f"invalid JSON body{at}: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        if tuple(err.get("loc", ())) == ("body",):
            parts.append(_body_problem(err))
            continue
        param = param or (where or None)
        if member is not None:
            if where not in unions:
                parts.append(where)  # filled in below, once every member is known
                unions[where] = []
            if member not in unions[where]:
                unions[where].append(member)
        elif err.get("type") == "extra_forbidden":
            parts.append(f"unsupported parameter '{where}'")
        elif err.get("type") == "missing":
            parts.append(f"missing required parameter '{where}'")
        else:
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    parts = [f"{p} must be {_one_of(unions[p])}" if p in unions else p for p in parts]
    return "; ".join(parts) or "invalid request", param


def _unreadable_body(exc: StarletteHTTPException) -> str:
    """Why FastAPI could not parse a body (its own message names no cause)."""
    if isinstance(exc.__cause__, UnicodeDecodeError):
        return f"the request body is not valid UTF-8: {exc.__cause__.reason} at byte {exc.__cause__.start}"
    if isinstance(exc.__cause__, RecursionError):
        return "the request body is not valid JSON: it is nested too deeply"
    return str(exc.detail)


# OpenAI API endpoints a text-generation server does not serve: their 404 says so (FastAPI's says "Not Found")
UNSERVED_ENDPOINTS = ("audio", "images", "moderations", "files", "uploads", "batches", "fine_tuning",
                      "assistants", "threads", "vector_stores", "realtime", "evals", "containers", "videos")


def _not_found(path: str) -> str:
    resource = path.removeprefix("/v1/").split("/", 1)[0]
    if path.startswith("/v1/") and resource in UNSERVED_ENDPOINTS:
        return (f"{path} is not served: tpserve serves text generation (/v1/chat/completions, /v1/completions, "
                "/v1/responses, /v1/conversations), /v1/embeddings, /v1/score, /v1/rerank and /v1/classify")
    return (f"no route {path} (the API is under /v1: chat/completions, completions, responses, conversations, "
            "embeddings, score, rerank, classify, models)")


class JsonByDefault:
    """ASGI middleware: a request without a Content-Type is read as JSON (FastAPI's strict default
    would leave it unparsed; ``requests.post(url, data=json.dumps(body))`` sends none)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not any(name == b"content-type" for name, _ in scope.get("headers") or []):
            scope = {**scope, "headers": [*scope.get("headers", []), (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-style error bodies for every error: ours, FastAPI's validation (as 400), unreadable bodies, the rest."""
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param, "invalid_request"), 400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not read the body
            return JSONResponse(error_body(_unreadable_body(exc), "invalid_request_error", code="invalid_request"), 400)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        path = request.url.path.removeprefix(request.scope.get("root_path", ""))  # without a proxy's prefix
        message = _not_found(path or "/") if exc.status_code == 404 else str(exc.detail)
        return JSONResponse(error_body(message, kind), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal server error: {exc}", "server_error"), 500)
