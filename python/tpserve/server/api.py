"""The FastAPI application: OpenAI-compatible routes plus health, version, metrics, flush,
tokenize and detokenize."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import tpserve
from tpserve.launch.args import ServerArgs
from tpserve.server.errors import APIError, error_body
from tpserve.server.limits import BodySizeLimit, RequestLimits
from tpserve.message.frontend import TokenizeRequest
from tpserve.sampling_params import SamplingParams
from tpserve.server.metrics import CONTENT_TYPE, ServerMetrics
from tpserve.server.conversation_store import ConversationStore
from tpserve.server.conversations import (
    add_items,
    create_conversation,
    delete_conversation,
    delete_item,
    get_item,
    list_items,
    update_conversation,
)
from tpserve.server.pages import DEFAULT_LIMIT
from tpserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ConversationCreateBody,
    ConversationItemsBody,
    ConversationUpdateBody,
    DetokenizeBody,
    ResponsesRequest,
    TokenizeBody,
)
from tpserve.server.response_store import ResponseStore
from tpserve.server.responses import (
    cancel_response,
    create_response,
    delete_response,
    get_response,
    list_input_items,
)
from tpserve.server.serving import Serving
from tpserve.tokenizer.prepare import InvalidRequest, PromptLimits, PromptPreparer

logger = logging.getLogger(__name__)


class TokenizeService:
    """/tokenize and /detokenize: the model's tokenizer (and chat template) in the API server,
    loaded on first use, run off the event loop. Their inputs have the completion endpoints' size limits."""

    def __init__(self, model_dir: str, chat_template: str | None, limits: RequestLimits) -> None:
        self._model_dir = model_dir
        self._chat_template = chat_template
        self._limits = limits
        self._tokenizer: Any = None
        self._lock = asyncio.Lock()

    async def _load(self) -> Any:
        async with self._lock:
            if self._tokenizer is None:
                from tpserve.tokenizer.loader import load_tokenizer

                self._tokenizer = await asyncio.to_thread(load_tokenizer, self._model_dir, self._chat_template)
        return self._tokenizer

    async def tokenize(self, body: TokenizeBody) -> dict[str, Any]:
        body.check()
        messages = [m.to_template(i) for i, m in enumerate(body.messages or [])]
        if body.prompt is not None:
            self._limits.check_text(len(body.prompt), "prompt")
        else:
            self._limits.check_chat(messages, body.tools, body.chat_template_kwargs)
        if body.prompt is not None:
            tokenizer = await self._load()
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            ids = await self.chat_ids(TokenizeRequest(
                rid=0, params=SamplingParams(), messages=messages,
                chat_template_kwargs=body.chat_template_kwargs, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tools=body.tools or None,
            ))
        return {"tokens": list(ids), "count": len(ids), "max_model_len": self._limits.context_len}

    async def chat_ids(self, req: TokenizeRequest) -> list[int]:
        """A chat request's prompt tokens, rendered and encoded as the tokenizer worker does (a
        template error: 400)."""
        tokenizer = await self._load()
        preparer = PromptPreparer(tokenizer, PromptLimits(self._limits.context_len, len(tokenizer)))
        try:
            ids, _, _ = await asyncio.to_thread(preparer.input_ids, req)
        except InvalidRequest as e:
            raise APIError.invalid(e.message, e.param) from e
        return ids

    async def count_chat(self, req: TokenizeRequest) -> int:
        return len(await self.chat_ids(req))

    async def detokenize(self, body: DetokenizeBody) -> dict[str, Any]:
        self._limits.check_ids(len(body.tokens), "tokens")
        return {"prompt": await self.decode(body.tokens, "tokens")}

    async def decode(self, tokens: list[int], param: str = "prompt") -> str:
        tokenizer = await self._load()
        bad = [t for t in tokens if not 0 <= t < len(tokenizer)]
        if bad:
            raise APIError.invalid(f"token id {bad[0]} is out of range [0, {len(tokenizer)})", param)
        return await asyncio.to_thread(tokenizer.decode, tokens)


@dataclass
class AppState:
    """Everything the routes use (kept in ``app.state.server``)."""

    args: ServerArgs
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    serving: Serving | None = None  # set once the backend is ready, unset when stopping
    stopping: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    tokenize: TokenizeService | None = None  # /tokenize and /detokenize, made on first use
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses with store: true
    conversations: ConversationStore = field(default_factory=ConversationStore)  # /v1/conversations
    # Why the backend is not live (a rank stopped making progress), or None; set once serving.
    liveness: Callable[[], str | None] | None = None

    def tokenize_service(self) -> TokenizeService:
        if self.tokenize is None:
            limits = RequestLimits(self.args.context_len, self.args.max_sequences_per_request)
            self.tokenize = TokenizeService(self.args.model_dir, self.args.chat_template, limits)
        return self.tokenize


def _state(request: Request) -> AppState:
    return request.app.state.server


def _check_api_key(request: Request) -> None:
    key = _state(request).args.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise APIError.unauthorized()


def _serving(request: Request) -> Serving:
    state = _state(request)
    if state.serving is None:
        raise APIError.stopping() if state.stopping else APIError.not_ready()
    return state.serving


def _model_card(state: AppState, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "tpserve",
        "root": state.args.model_dir,
        "parent": None,
        "max_model_len": state.args.context_len,
    }


def _model_names(state: AppState) -> tuple[str, ...]:
    return (state.args.served_model_name, *state.args.model_aliases)


def _v1_router() -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_check_api_key)])

    @router.get("/models")
    async def list_models(request: Request) -> dict[str, Any]:
        state = _state(request)
        return {"object": "list", "data": [_model_card(state, name) for name in _model_names(state)]}

    @router.get("/models/{model:path}")
    async def get_model(model: str, request: Request) -> dict[str, Any]:
        state = _state(request)
        if model not in _model_names(state):
            raise APIError.model_not_found(model)
        return _model_card(state, model)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _serving(request).chat(body, request)

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _serving(request).completion(body, request, _state(request).tokenize_service().decode)

    @router.post("/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        state = _state(request)
        return await create_response(_serving(request), state.responses, state.conversations, body, request,
                                     state.tokenize_service().count_chat)

    @router.get("/responses/{response_id}", response_model=None)
    async def get_stored_response(
        response_id: str, request: Request, stream: bool = False, starting_after: int | None = None,
    ) -> dict[str, Any] | Response:
        return get_response(_state(request).responses, response_id, stream, starting_after)

    @router.post("/responses/{response_id}/cancel")
    async def cancel_background_response(response_id: str, request: Request) -> dict[str, Any]:
        return await cancel_response(_state(request).responses, response_id)

    @router.get("/responses/{response_id}/input_items")
    async def stored_input_items(
        response_id: str, request: Request, after: str | None = None, before: str | None = None,
        limit: int = Query(DEFAULT_LIMIT, ge=1, le=100), order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        return list_input_items(_state(request).responses, response_id, after, before, limit, order)

    @router.delete("/responses/{response_id}")
    async def delete_stored_response(response_id: str, request: Request) -> dict[str, Any]:
        return delete_response(_state(request).responses, response_id)

    _conversation_routes(router)
    return router


def _conversation_routes(router: APIRouter) -> None:
    """OpenAI's Conversations API (``server/conversations.py``)."""

    @router.post("/conversations")
    async def new_conversation(body: ConversationCreateBody, request: Request) -> dict[str, Any]:
        state = _state(request)
        return create_conversation(state.conversations, state.responses, body)

    @router.get("/conversations/{conversation_id}")
    async def get_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
        return _state(request).conversations.get(conversation_id).obj()

    @router.post("/conversations/{conversation_id}")
    async def post_conversation(conversation_id: str, body: ConversationUpdateBody, request: Request) -> dict[str, Any]:
        return update_conversation(_state(request).conversations, conversation_id, body)

    @router.delete("/conversations/{conversation_id}")
    async def remove_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
        return delete_conversation(_state(request).conversations, conversation_id)

    @router.post("/conversations/{conversation_id}/items")
    async def new_items(conversation_id: str, body: ConversationItemsBody, request: Request) -> dict[str, Any]:
        state = _state(request)
        return add_items(state.conversations, state.responses, conversation_id, body)

    @router.get("/conversations/{conversation_id}/items")
    async def conversation_items(
        conversation_id: str, request: Request, after: str | None = None,
        limit: int = Query(DEFAULT_LIMIT, ge=1, le=100), order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        return list_items(_state(request).conversations, conversation_id, after, limit, order)

    @router.get("/conversations/{conversation_id}/items/{item_id}")
    async def conversation_item(conversation_id: str, item_id: str, request: Request) -> dict[str, Any]:
        return get_item(_state(request).conversations, conversation_id, item_id)

    @router.delete("/conversations/{conversation_id}/items/{item_id}")
    async def remove_item(conversation_id: str, item_id: str, request: Request) -> dict[str, Any]:
        return delete_item(_state(request).conversations, conversation_id, item_id)


def _admin_router() -> APIRouter:
    router = APIRouter()

    @router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
    async def health(request: Request) -> Response:
        _serving(request)  # 503 while starting or stopping
        state = _state(request)
        problem = state.liveness() if state.liveness is not None else None
        if problem is not None:
            raise APIError(503, problem, type="server_error", code="backend_stalled")
        return JSONResponse({"status": "ok"})

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tpserve.__version__}

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)

    @router.post("/tokenize", dependencies=[Depends(_check_api_key)])
    async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
        return await _state(request).tokenize_service().tokenize(body)

    @router.post("/detokenize", dependencies=[Depends(_check_api_key)])
    async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, Any]:
        return await _state(request).tokenize_service().detokenize(body)

    @router.post("/flush_cache", dependencies=[Depends(_check_api_key)])
    async def flush_cache(request: Request) -> dict[str, str]:
        await _serving(request).frontend.flush_cache()
        return {"status": "ok", "message": "prefix cache flush requested"}

    return router


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


class JsonByDefault:
    """ASGI middleware: a request without a Content-Type is read as JSON (FastAPI's strict default
    would leave it unparsed; ``requests.post(url, data=json.dumps(body))`` sends none)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not any(name == b"content-type" for name, _ in scope.get("headers") or []):
            scope = {**scope, "headers": [*scope.get("headers", []), (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
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
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal server error: {exc}", "server_error"), 500)


def create_app(state: AppState) -> FastAPI:
    # The OpenAPI schema is public only where the API is (no --api-key).
    openapi_url = "/openapi.json" if state.args.api_key is None else None
    app = FastAPI(title="tpserve", version=tpserve.__version__, docs_url=None, redoc_url=None, openapi_url=openapi_url)
    app.add_middleware(BodySizeLimit, max_bytes=state.args.max_request_bytes)
    app.add_middleware(JsonByDefault)
    app.state.server = state
    app.include_router(_admin_router())
    app.include_router(_v1_router())
    _install_error_handlers(app)
    return app
