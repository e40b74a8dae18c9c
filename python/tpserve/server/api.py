"""The FastAPI application: OpenAI-compatible routes plus health, version, metrics, flush,
tokenize and detokenize."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import tpserve
from tpserve.launch.args import ServerArgs
from tpserve.server.errors import APIError, check_model_name
from tpserve.server.limits import BodySizeLimit, RequestLimits
from tpserve.server.lora_updates import LoadLoRAAdapterRequest, LoRAUpdates, ServedAdapters, UnloadLoRAAdapterRequest
from tpserve.server.metrics import CONTENT_TYPE, CountResponses, ServerMetrics, TrackServerLoad
from tpserve.server.conversation_store import ConversationStore
from tpserve.server.classify import ClassifyRequest, create_classification
from tpserve.server.embeddings import EmbeddingRequest, create_embeddings
from tpserve.server.scores import RerankRequest, ScoreRequest, create_rerank, create_scores
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
from tpserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeBody, TokenizeBody
from tpserve.server.response_store import ResponseStore
from tpserve.server.responses_protocol import (
    ConversationCreateBody,
    ConversationItemsBody,
    ConversationUpdateBody,
    ResponsesRequest,
)
from tpserve.server.responses import (
    cancel_response,
    create_response,
    delete_response,
    get_response,
    list_input_items,
)
from tpserve.server.request_errors import JsonByDefault, install_error_handlers
from tpserve.server.request_id import RequestIdHeader
from tpserve.server.serving import Serving
from tpserve.server.tokenize_service import TokenizeService



@dataclass
class AppState:
    """Everything the routes use (kept in ``app.state.server``)."""

    args: ServerArgs
    metrics: ServerMetrics = field(init=False)
    serving: Serving | None = None  # set once the backend is ready, unset when stopping
    stopping: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    tokenize: TokenizeService | None = None  # /tokenize and /detokenize, made on first use
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses with store: true
    conversations: ConversationStore = field(default_factory=ConversationStore)  # /v1/conversations
    # Why the backend is not live (a rank stopped making progress), or None; set once serving.
    liveness: Callable[[], str | None] | None = None

    adapters: ServedAdapters = field(init=False)  # the LoRA adapters requests may name
    lora_updates: LoRAUpdates = field(init=False)  # /v1/load_lora_adapter, /v1/unload_lora_adapter

    def __post_init__(self) -> None:
        args = self.args
        self.metrics = ServerMetrics(args.served_model_name, args.engine.lora_slots or None)
        self.adapters = ServedAdapters(args.engine.lora_modules)
        self.lora_updates = LoRAUpdates(self.adapters, (args.served_model_name, *args.model_aliases),
                                        args.engine.max_lora_rank, args.engine.dp_size,
                                        args.allow_runtime_lora_updating)

    def tokenize_service(self) -> TokenizeService:
        if self.tokenize is None:
            limits = RequestLimits(self.args.context_len, self.args.max_sequences_per_request)
            self.tokenize = TokenizeService(self.args.model_dir, self.args.chat_template, limits,
                                            self.args.trust_request_chat_template,
                                            self.args.default_chat_template_kwargs)
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
    """The model's card, or a LoRA adapter's (as vLLM's: its directory as root, the model as parent)."""
    adapter = state.adapters.path(name)
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "tpserve",
        "root": adapter or state.args.model_dir,
        "parent": state.args.served_model_name if adapter is not None else None,
        "max_model_len": state.args.context_len,
    }


def _model_names(state: AppState) -> tuple[str, ...]:
    """The model's names, then its LoRA adapters'."""
    return (state.args.served_model_name, *state.args.model_aliases, *state.adapters)


async def _classify(body: ClassifyRequest, request: Request) -> Response:
    return await create_classification(_serving(request), body, request)


async def _score(body: ScoreRequest, request: Request) -> Response:
    return await create_scores(_serving(request), body, request)


async def _rerank(body: RerankRequest, request: Request) -> Response:
    return await create_rerank(_serving(request), body, request)


# vLLM's pooling APIs, served at /v1/... and at vLLM's paths without it
_POOLING_ROUTES = {"/classify": _classify, "/score": _score, "/rerank": _rerank}


def _v1_router() -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_check_api_key)])

    @router.get("/models")
    async def list_models(request: Request) -> dict[str, Any]:
        state = _state(request)
        return {"object": "list", "data": [_model_card(state, name) for name in _model_names(state)]}

    @router.get("/models/{model:path}")
    async def get_model(model: str, request: Request) -> dict[str, Any]:
        state = _state(request)
        check_model_name(model, _model_names(state))
        return _model_card(state, model)

    @router.post("/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> str:
        state = _state(request)
        return await state.lora_updates.load(_serving(request).frontend, body)

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> str:
        state = _state(request)
        return await state.lora_updates.unload(_serving(request).frontend, body)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _serving(request).chat(body, request)

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _serving(request).completion(body, request, _state(request).tokenize_service().decode)

    @router.post("/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await create_embeddings(_serving(request), body, request)

    for path, handler in _POOLING_ROUTES.items():
        router.add_api_route(path, handler, methods=["POST"])

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
    @router.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's health check)
    async def health(request: Request) -> Response:
        _serving(request)  # 503 while starting or stopping
        state = _state(request)
        problem = state.liveness() if state.liveness is not None else None
        if problem is not None:
            raise APIError(503, problem, type="server_error", code="backend_stalled")
        return JSONResponse({"status": "ok"})

    @router.get("/load")  # vLLM's; 0 unless --enable-server-load-tracking
    async def load(request: Request) -> dict[str, int]:
        return {"server_load": _state(request).metrics.server_load}

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tpserve.__version__}

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)

    @router.post("/tokenize", dependencies=[Depends(_check_api_key)])
    async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
        check_model_name(body.model, _model_names(_state(request)))
        return await _state(request).tokenize_service().tokenize(body)

    @router.post("/detokenize", dependencies=[Depends(_check_api_key)])
    async def detokenize(body: DetokenizeBody, request: Request) -> dict[str, Any]:
        check_model_name(body.model, _model_names(_state(request)))
        return await _state(request).tokenize_service().detokenize(body)

    # vLLM's other paths of the classify, score and rerank APIs (/v1/classify, /v1/score, /v1/rerank are the v1 router's)
    for path, handler in {**_POOLING_ROUTES, "/v2/rerank": _POOLING_ROUTES["/rerank"]}.items():
        router.add_api_route(path, handler, methods=["POST"], dependencies=[Depends(_check_api_key)])

    @router.post("/flush_cache", dependencies=[Depends(_check_api_key)])
    @router.post("/reset_prefix_cache", dependencies=[Depends(_check_api_key)])  # vLLM's name
    async def flush_cache(request: Request) -> dict[str, str]:
        await _serving(request).frontend.flush_cache()
        return {"status": "ok", "message": "prefix cache flush requested"}

    return router


def create_app(state: AppState) -> FastAPI:
    # The OpenAPI schema is public only where the API is (no --api-key).
    openapi_url = "/openapi.json" if state.args.api_key is None else None
    # root_path on the app (as vLLM sets it), not uvicorn's: paths are served with the proxy's prefix and without
    app = FastAPI(title="tpserve", version=tpserve.__version__, docs_url=None, redoc_url=None, openapi_url=openapi_url,
                  root_path=state.args.root_path)
    app.add_middleware(BodySizeLimit, max_bytes=state.args.max_request_bytes)
    app.add_middleware(JsonByDefault)
    app.add_middleware(RequestIdHeader)
    app.add_middleware(CountResponses, metrics=state.metrics)  # sees the body-size limit's 413 too
    if state.args.enable_server_load_tracking:
        app.add_middleware(TrackServerLoad, metrics=state.metrics)
    args = state.args
    if args.allowed_origins:  # outside the others: a browser's preflight is answered before anything else runs
        app.add_middleware(CORSMiddleware, allow_origins=list(args.allowed_origins),
                           allow_methods=list(args.allowed_methods), allow_headers=list(args.allowed_headers),
                           allow_credentials=args.allow_credentials)
    app.state.server = state
    app.include_router(_admin_router())
    app.include_router(_v1_router())
    install_error_handlers(app)
    return app
