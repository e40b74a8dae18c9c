"""The backend requests of one API call (one per prompt), read as one stream of events."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from tpserve.message.frontend import ApiOutput, RequestRejected, TokenizeRequest, TokenLogprob
from tpserve.server.errors import APIError
from tpserve.server.client import BackendEvent, FrontendClient, RequestCancelled
from tpserve.server.metrics import RequestTimer, ServerMetrics

DISCONNECT_POLL_S = 1.0


@dataclass
class Choice:
    """Progress of one prompt (one backend rid)."""

    index: int
    rid: int
    timer: RequestTimer
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    started: bool = False  # the backend answered at least once
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_in_reasoning: bool = False  # the prompt ends inside an open think block
    matched_stop: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Generation:
    """Submits the requests, then yields ``(choice, output)`` as outputs arrive.

    A rejection or a backend error raises APIError; ``abort`` stops whatever still runs.
    """

    def __init__(
        self,
        frontend: FrontendClient,
        metrics: ServerMetrics,
        requests: list[TokenizeRequest],
        choices_per_prompt: int = 1,
        timeout: float | None = None,
    ) -> None:
        self._choices_per_prompt = choices_per_prompt
        self._frontend = frontend
        self._metrics = metrics
        self._requests = requests
        self._queue: asyncio.Queue[BackendEvent] = asyncio.Queue()
        self.choices = {req.rid: Choice(i, req.rid, RequestTimer(metrics)) for i, req in enumerate(requests)}
        self._last_disconnect_check = time.monotonic()
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout

    async def start(self) -> None:
        await self._frontend.submit(self._requests, self._queue)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices.values())

    @property
    def all_started(self) -> bool:
        return all(c.started or c.finished for c in self.choices.values())

    def usage(self) -> dict[str, Any]:
        """Prompt tokens count once per prompt (not per choice), as OpenAI counts them with n > 1."""
        firsts = [c for c in self.choices.values() if c.index % self._choices_per_prompt == 0]
        prompt_tokens = sum(c.prompt_tokens for c in firsts)
        completion_tokens = sum(c.completion_tokens for c in self.choices.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)},
        }

    async def next(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> tuple[Choice, ApiOutput]:
        """The next output. Raises APIError (rejected, backend error, timed out) or ClientGone."""
        while True:
            now = time.monotonic()
            if self._deadline is not None and now >= self._deadline:
                raise APIError(504, f"the request did not finish within {self._timeout:g} s (--request-timeout)",
                               type="server_error", code="request_timeout")
            if is_disconnected is not None and now - self._last_disconnect_check >= DISCONNECT_POLL_S:
                self._last_disconnect_check = now
                if await is_disconnected():
                    raise ClientGone()
            wait = DISCONNECT_POLL_S if is_disconnected is not None else None
            if self._deadline is not None:
                wait = min(wait or math.inf, self._deadline - now)
            try:
                event = await asyncio.wait_for(self._queue.get(), wait)
            except asyncio.TimeoutError:
                continue
            return self._apply(event)

    def _apply(self, event: BackendEvent) -> tuple[Choice, ApiOutput]:
        choice = self.choices[event.rid]
        if isinstance(event, RequestCancelled):
            choice.finish_reason = "abort"
            raise APIError(503, event.message, type="server_error", code="shutting_down")
        if isinstance(event, RequestRejected):
            choice.finish_reason = "rejected"
            self._metrics.rejected.inc()
            invalid = event.status < 500
            raise APIError(event.status, event.message, param=event.param,
                           type="invalid_request_error" if invalid else "server_error",
                           code="invalid_request" if invalid else "internal_error")
        choice.started = True
        choice.prompt_in_reasoning = event.prompt_in_reasoning
        choice.matched_stop = event.matched_stop
        choice.text.append(event.text)
        if event.logprobs:
            choice.logprobs.extend(event.logprobs)
        choice.prompt_tokens = event.prompt_tokens
        choice.completion_tokens = event.completion_tokens
        choice.cached_tokens = event.cached_tokens
        choice.timer.on_output(event.new_tokens, event.prompt_tokens)
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
            choice.timer.on_finish(event.finish_reason)
            if event.finish_reason == "error":
                raise APIError(400, event.error or "the request failed in the scheduler", code="invalid_request")
        return choice, event

    async def abort(self, client_gone: bool = False) -> None:
        """Abort every unfinished choice (frees their KV pages)."""
        for choice in self.choices.values():
            if not choice.finished:
                choice.finish_reason = "abort"
                if client_gone:
                    self._metrics.client_aborts.inc()
                await self._frontend.abort(choice.rid)


class ClientGone(Exception):
    """The HTTP client disconnected."""
