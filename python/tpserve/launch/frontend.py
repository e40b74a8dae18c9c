"""The API's backend under this process: start the ranks, tokenizers and detokenizer, connect the frontend
client (and the data-parallel router), and set ``state.serving`` while they run; watch them; stop them. Shared by
the HTTP server (``launch.http``) and ``tpserve run-batch`` (``launch.batch``), which drives the same app
in-process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from tpserve.launch.args import ServerArgs
from tpserve.launch.backend import Backend, ChildDied, StartupCancelled
from tpserve.router.policy import Dispatch
from tpserve.sampling_defaults import describe as describe_defaults
from tpserve.server.api import AppState
from tpserve.server.client import FrontendClient, ReplicaRouter
from tpserve.server.limits import RequestLimits
from tpserve.server.serving import Serving

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5


@dataclass
class Running:
    backend: Backend
    tasks: list[asyncio.Task]  # the frontend's own (its dispatcher, the DP router's)


@contextlib.asynccontextmanager
async def serving_backend(
    args: ServerArgs, state: AppState, stop: asyncio.Event, watched: asyncio.Task | None = None,
    before_close: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[Running | None]:
    """Inside: the backend running and ``state.serving`` set, or None where start-up failed, ``stop`` was set or
    ``watched`` (the HTTP server) ended first. On the way out: new requests get 503, open ones end
    (``before_close`` then runs: the HTTP server's graceful close), and every child is stopped."""
    backend = Backend(args.engine, args.log_level, args)
    dispatch = Dispatch.for_replicas(args.engine, args.load_balance_method,
                                     lambda: backend.stalled_replicas(args.health_timeout))
    frontend = FrontendClient(backend.endpoints, state.metrics.on_stats, state.metrics.on_aborted_finish, dispatch)
    router = None if dispatch is None else ReplicaRouter(backend.endpoints, dispatch)
    if dispatch is not None:
        state.metrics.watch_router(dispatch.router)
    tasks: list[asyncio.Task] = []
    try:
        backend.start()
        if not await _wait_ready(backend, stop, watched):
            yield None
            return
        tasks.append(asyncio.create_task(frontend.run(), name="dispatcher"))
        if router is not None:
            tasks.append(asyncio.create_task(router.run(), name="router"))
        state.serving = Serving(
            frontend, state.metrics, args.served_model_name,
            RequestLimits(args.context_len, args.max_sequences_per_request), args.model_aliases,
            args.reasoning_parser, args.tool_call_parser, request_timeout=args.request_timeout,
            sampling_defaults=args.sampling_defaults,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            trust_request_chat_template=args.trust_request_chat_template, head=args.head,
            tokens_as_ids=args.return_tokens_as_token_ids,
            force_include_usage=args.enable_force_include_usage,
            priority_scheduling=args.engine.schedule_policy == "priority", prompts=state.tokenize_service(),
            lora_adapters=state.adapters,
        )
        state.liveness = lambda: backend.stalled(args.health_timeout)
        if args.sampling_defaults:
            logger.info("requests that leave them unset sample with %s (the model's generation config; "
                        "--generation-config vllm: none)", describe_defaults(args.sampling_defaults))
        yield Running(backend, tasks)
    finally:
        state.serving = None  # new requests: 503
        state.stopping = True
        frontend.cancel_all("the server is shutting down")  # open streams end cleanly
        if before_close is not None:
            await before_close()
        for task in tasks:
            task.cancel()
        await asyncio.to_thread(backend.shutdown)
        frontend.close()
        if router is not None:
            router.close()
        logger.info("stopped")


async def _wait_ready(backend: Backend, stop: asyncio.Event, watched: asyncio.Task | None) -> bool:
    """True once every child acknowledged; False on a signal, a start-up failure or ``watched`` ending."""
    cancel = threading.Event()
    ready = asyncio.create_task(asyncio.to_thread(backend.wait_ready, cancel))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([ready, stopped, *([watched] if watched else [])], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    cancel.set()
    try:
        await ready
    except StartupCancelled:
        return False
    except ChildDied as e:
        logger.error("start-up failed: %s", e)
        return False
    if watched is not None and watched.done():
        logger.error("the HTTP server stopped during start-up")
        return False
    return not stop.is_set()


async def watch(backend: Backend, stop: asyncio.Event, tasks: list[asyncio.Task]) -> int:
    """Run until a signal (0) or a dead child or task (1)."""
    while True:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), WATCH_INTERVAL_S)
        if stop.is_set():
            return 0
        dead = backend.dead_child()
        if dead is not None:
            logger.error("%s: shutting down", dead)
            return 1
        for task in tasks:
            if task.done():
                exc = None if task.cancelled() else task.exception()
                logger.error("the %s task stopped (%r): shutting down", task.get_name(), exc)
                return 1
