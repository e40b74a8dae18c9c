"""One call's backend requests (one per prompt and choice) read as one stream of events: ``Generation``."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from tpserve.message.frontend import ApiOutput, RequestRejected, TokenizeRequest
from tpserve.server.client import BackendEvent, FrontendClient, RequestCancelled
from tpserve.server.errors import APIError
from tpserve.server.formats import Choice
from tpserve.server.metrics import RequestTimer, ServerMetrics

DISCONNECT_POLL_S = 1.0


@dataclass
class _ClientWatch:
    """When the client was last asked whether it is still connected; shared by a call's generations."""

    last: float = field(default_factory=time.monotonic)


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
        shown: bool = True,
        within: Generation | None = None,
    ) -> None:
        """``shown`` False: the generated tokens are not shown (``echo`` with ``max_tokens`` 0) nor counted.
        ``within``: the call this is part of (a beam search's step), whose deadline and client watch it shares."""
        self._choices_per_prompt = choices_per_prompt
        self._frontend = frontend
        self._metrics = metrics
        self._requests = requests
        self._queue: asyncio.Queue[BackendEvent] = asyncio.Queue()
        rids = [rid for req in requests for rid in req.choice_rids]
        self.choices = {rid: Choice(i, rid, RequestTimer(metrics, shown)) for i, rid in enumerate(rids)}
        self._watch = _ClientWatch() if within is None else within._watch
        self._timeout = timeout if within is None else within._timeout
        own_deadline = None if timeout is None else time.monotonic() + timeout
        self._deadline = own_deadline if within is None else within._deadline

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

    def streamed_usage(self, index: int) -> dict[str, Any]:
        """One choice's usage as its stream has sent it (continuous_usage_stats, as vLLM's): its prompt and the
        completion tokens of its chunks so far."""
        choice = next(c for c in self.choices.values() if c.index == index)
        return {"prompt_tokens": choice.prompt_tokens, "completion_tokens": choice.streamed_tokens,
                "total_tokens": choice.prompt_tokens + choice.streamed_tokens}

    async def next(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> tuple[Choice, ApiOutput]:
        """The next output. Raises APIError (rejected, backend error, timed out) or ClientGone."""
        while True:
            now = time.monotonic()
            if self._deadline is not None and now >= self._deadline:
                raise APIError(504, f"the request did not finish within {self._timeout:g} s (--request-timeout)",
                               type="server_error", code="request_timeout")
            if is_disconnected is not None and now - self._watch.last >= DISCONNECT_POLL_S:
                self._watch.last = now
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

    def next_ready(self) -> tuple[Choice, ApiOutput] | None:
        """The next output if one has arrived already (None: none has, or all are done), without waiting.
        Raises APIError as ``next`` does."""
        if self.finished or self._queue.empty():
            return None
        return self._apply(self._queue.get_nowait())

    def _apply(self, event: BackendEvent) -> tuple[Choice, ApiOutput]:
        choice = self.choices[event.rid]
        if isinstance(event, RequestCancelled):
            choice.finish_reason = "abort"
            raise APIError(503, event.message, type="server_error", code="shutting_down")
        if isinstance(event, RequestRejected):
            # the prompt's other choices are refused alike (the same prompt and limits): counted, and not aborted
            group = [c for c in self.choices.values()
                     if c.index // self._choices_per_prompt == choice.index // self._choices_per_prompt]
            for sibling in group:
                sibling.finish_reason = "rejected"
            self._metrics.rejected.inc(len(group))
            invalid = event.status < 500
            raise APIError(event.status, event.message, param=event.param,
                           type="invalid_request_error" if invalid else "server_error",
                           code="invalid_request" if invalid else "internal_error")
        choice.started = True
        choice.prompt_in_reasoning = event.prompt_in_reasoning
        choice.matched_stop = event.matched_stop
        choice.text.append(event.text)
        choice.text_tokens.append(event.new_tokens)
        if event.logprobs:
            choice.logprobs.extend(event.logprobs)
        if event.prompt_logprobs:
            choice.prompt_logprobs = event.prompt_logprobs
        if event.embedding is not None:
            choice.embedding = event.embedding
        choice.prompt_tokens = event.prompt_tokens
        choice.completion_tokens = event.completion_tokens
        choice.cached_tokens = event.cached_tokens
        choice.timer.on_output(event.new_tokens, event.prompt_tokens, embedded=event.embedding is not None)
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
