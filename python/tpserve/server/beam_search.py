"""``use_beam_search`` on /v1/chat/completions and /v1/completions (vLLM's extension): ``tpserve.beam_search``'s
search, each step's live beams sent to the backend as plain one-token requests (every prompt's together), then each
prompt's best beams handed to the response format as one finished output each (streamed: one chunk per beam at the
end, as vLLM's)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace

import contextlib

import msgspec

from tpserve.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence
from tpserve.message.frontend import ApiOutput, TokenizeRequest, TokenLogprob
from tpserve.server.client import FrontendClient
from tpserve.server.formats import Choice
from tpserve.server.generation import Generation
from tpserve.server.lora_updates import ServedAdapters
from tpserve.server.metrics import ServerMetrics
from tpserve.server.tokenize_service import TokenizeService


class BeamGeneration(Generation):
    """A ``Generation`` whose choices are the beams: its first ``next`` runs the whole search (watching the client),
    then the beams come out as any outputs do. ``requests``: one per prompt, with beam_width choice rids each."""

    def __init__(self, frontend: FrontendClient, metrics: ServerMetrics, requests: list[TokenizeRequest],
                 params: BeamSearchParams, prompts: TokenizeService, timeout: float | None = None,
                 top_logprobs: int | None = None, adapters: ServedAdapters | None = None) -> None:
        """``adapters``: the served LoRA adapters, one of which the search may name (it pins it while it runs)."""
        super().__init__(frontend, metrics, requests, params.beam_width, timeout)
        self._params, self._prompts, self._top_logprobs = params, prompts, top_logprobs
        self._adapters = adapters
        for choice in self.choices.values():  # the beams are no backend requests: their steps' requests are counted
            choice.timer = _NotTimed()  # type: ignore[assignment]
        self._searched = False
        self._step: Generation | None = None  # the step in flight

    async def start(self) -> None:
        """Nothing goes to the backend before the first ``next``."""

    async def next(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> tuple[Choice, ApiOutput]:
        if not self._searched:
            self._searched = True
            lora, adapters = self._requests[0].params.lora, self._adapters
            # every step names the adapter: an unload waits for the search, which ends with the adapter it began with
            with adapters.pinned(lora) if lora is not None and adapters is not None else contextlib.nullcontext():
                await self._search(is_disconnected)
        return await super().next(is_disconnected)

    async def abort(self, client_gone: bool = False) -> None:
        if self._step is not None:
            await self._step.abort(client_gone)
        for choice in self.choices.values():
            choice.finish_reason = choice.finish_reason or "abort"

    async def _search(self, is_disconnected: Callable[[], Awaitable[bool]] | None) -> None:
        eos = await self._prompts.eos_token_id()
        searches, prepared = [], []
        for req in self._requests:
            ready = await self._prompts.prepare(req)  # the worker's checks: a bad prompt is its 400 here
            params = replace(self._params, max_tokens=ready.generate.params.max_tokens)
            searches.append(BeamSearch(ready.generate.input_ids, params, eos))
            prepared.append(ready)
        first = self._requests[0].params
        step_params = self._params.step_params(seed=first.seed, cache_salt=first.cache_salt, priority=first.priority,
                                               lora=first.lora)
        width = step_params.logprobs  # the candidates each beam is extended with
        if self._top_logprobs is not None and self._top_logprobs > width:  # the answer shows as many as it asks
            step_params = msgspec.structs.replace(step_params, logprobs=self._top_logprobs)
        while live := [search for search in searches if not search.done]:
            beams = [beam for search in live for beam in search.live]
            step = [TokenizeRequest(rid=self._frontend.new_rid(), params=step_params, input_ids=beam.tokens,
                                    model_ids=True) for beam in beams]
            # the steps share the call's deadline and client watch: each step is far shorter than DISCONNECT_POLL_S,
            # so a watch of its own would never look at the client
            self._step = Generation(self._frontend, self._metrics, step, within=self)
            await self._step.start()
            while not self._step.finished:
                await self._step.next(is_disconnected)
            records = iter(choice.logprobs[0] for choice in sorted(self._step.choices.values(), key=lambda c: c.index))
            for search in live:
                search.advance([(_candidates(record, width), record)
                                for record in (next(records) for _ in search.live)])
            self._step = None
        rids = iter(rid for req in self._requests for rid in req.choice_rids)
        for search, ready in zip(searches, prepared):
            for beam in search.best():
                await self._queue.put(await self._output(next(rids), search, beam, ready.register.prompt_in_reasoning))

    async def _output(self, rid: int, search: BeamSearch, beam: BeamSearchSequence,
                      prompt_in_reasoning: bool | None) -> ApiOutput:
        tokens = search.token_ids(beam)  # vLLM's usage and logprobs: an EOS that ended it only where it was kept
        logprobs = None
        if self._top_logprobs is not None:
            logprobs = [_chosen(record, token, self._top_logprobs) for record, token in zip(beam.logprobs, tokens)]
        text = await self._prompts.decode(search.generated(beam), generated=True)
        return ApiOutput(rid=rid, text=text, new_tokens=len(tokens), completion_tokens=len(tokens),
                         prompt_tokens=search.prompt_len, finish_reason=beam.finish_reason,
                         matched_stop=beam.stop_reason, logprobs=logprobs, prompt_in_reasoning=prompt_in_reasoning)


class _NotTimed:
    def on_output(self, new_tokens: int, prompt_tokens: int, embedded: bool = False) -> None:
        pass

    def on_finish(self, finish_reason: str) -> None:
        pass


def _candidates(record: TokenLogprob, width: int) -> dict[int, float]:
    """A step's tokens to extend its beam with: the sampled one and the ``width`` most likely ones."""
    return {record.token_id: record.logprob,
            **{t: value for t, (_, _, value) in zip(record.top_ids[:width], record.top[:width])}}


def _chosen(record: TokenLogprob, token: int, top: int) -> TokenLogprob:
    """The step's log-probabilities as they read for the token the beam took there."""
    if token == record.token_id:
        text, raw, logprob = record.token, record.raw, record.logprob
    else:
        text, raw, logprob = record.top[record.top_ids.index(token)]
    return TokenLogprob(text, logprob, record.top[:top], raw, token, record.top_ids[:top])
