"""The detokenizer process: scheduler tokens -> text deltas for the API server (UTF-8 safe, stop
strings trimmed), and aborts for the requests a stop string ended.

``DetokenizerManager`` keeps the per-request state, free of sockets so it can be unit tested. A
request's registration (from its tokenizer worker) and its first tokens (from the scheduler) travel
on different connections, so tokens that arrive first are buffered until the registration comes.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import zmq

from tpserve.message import AbortRequest, BatchTokenOutput, TokenOutput
from tpserve.message.endpoints import Endpoints
from tpserve.message.frontend import ApiOutput, ApiOutputBatch, DetokenizeRegister, DetokenizerInput, TokenLogprob
from tpserve.message.transport import Receiver, Sender
from tpserve.tokenizer.loader import load_tokenizer
from tpserve.tokenizer.stream import Decoder, OutputText, token_bytes

logger = logging.getLogger(__name__)

FINISHED_MEMORY = 65536  # how many finished rids to remember (late tokens for them are dropped)
ORPHAN_TIMEOUT_S = 60.0  # buffered tokens of a never-registered rid are dropped after this


@dataclass
class _RequestState:
    text: OutputText
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_in_reasoning: bool | None = None


@dataclass
class _Orphan:
    since: float
    outputs: list[TokenOutput] = field(default_factory=list)


@dataclass
class DetokenizeResult:
    """What one input produced: a batch for the API server and aborts for the scheduler."""

    api: ApiOutputBatch | None
    aborts: list[AbortRequest]


class DetokenizerManager:
    def __init__(self, tokenizer: Decoder, clock=time.monotonic) -> None:
        self._tokenizer = tokenizer
        self._clock = clock
        self._states: dict[int, _RequestState] = {}
        self._orphans: dict[int, _Orphan] = {}
        self._finished: OrderedDict[int, None] = OrderedDict()
        self._token_text: dict[int, tuple[str, bytes]] = {}

    @property
    def num_active(self) -> int:
        return len(self._states)

    def register(self, msg: DetokenizeRegister) -> DetokenizeResult:
        self._states[msg.rid] = _RequestState(
            text=OutputText(self._tokenizer, msg.stop, msg.include_stop, msg.min_tokens, msg.skip_special_tokens),
            prompt_tokens=msg.prompt_tokens,
            prompt_in_reasoning=msg.prompt_in_reasoning,
        )
        orphan = self._orphans.pop(msg.rid, None)
        if orphan is None:
            return DetokenizeResult(None, [])
        return self._process(orphan.outputs, stats=None)

    def on_batch(self, batch: BatchTokenOutput) -> DetokenizeResult:
        self._drop_old_orphans()
        result = self._process(batch.outputs, batch.stats)
        if batch.lora is not None:  # passed on as it is
            api = result.api if result.api is not None else ApiOutputBatch(outputs=[], stats=batch.stats)
            result = DetokenizeResult(msgspec.structs.replace(api, lora=batch.lora), result.aborts)
        return result

    def _process(self, outputs: list[TokenOutput], stats) -> DetokenizeResult:
        api: list[ApiOutput] = []
        aborts: list[AbortRequest] = []
        for out in outputs:
            if out.rid in self._finished:
                continue  # e.g. tokens already in flight when a stop string ended the request
            state = self._states.get(out.rid)
            if state is None:
                self._orphans.setdefault(out.rid, _Orphan(self._clock())).outputs.append(out)
                continue
            result = self._step(out.rid, state, out)
            api.append(result)
            if result.finish_reason == "stop" and out.finish_reason is None:
                aborts.append(AbortRequest(rid=out.rid))  # free its KV pages now
        batch = ApiOutputBatch(outputs=api, stats=stats) if api or stats is not None else None
        return DetokenizeResult(batch, aborts)

    def _step(self, rid: int, state: _RequestState, out: TokenOutput) -> ApiOutput:
        text = state.text.add(out.token_ids, out.matched_stop, final=out.finish_reason is not None)
        out = out.cut(state.text.kept)  # not the tokens after a stop string (several tokens a step: drafts)
        state.completion_tokens += len(out.token_ids)
        state.prompt_tokens = out.prompt_tokens or state.prompt_tokens
        state.cached_tokens = max(state.cached_tokens, out.cached_tokens)
        stop = state.text.stop
        finish_reason = "stop" if stop.stopped else out.finish_reason
        if finish_reason is not None:
            self._forget(rid)
        return ApiOutput(
            rid=rid,
            text=text,
            new_tokens=len(out.token_ids),
            completion_tokens=state.completion_tokens,
            prompt_tokens=state.prompt_tokens,
            cached_tokens=state.cached_tokens,
            finish_reason=finish_reason,
            error=out.error,
            logprobs=self._logprobs(out),
            prompt_logprobs=self._prompt_logprobs(out),
            matched_stop=stop.matched if stop.stopped else out.matched_stop,
            prompt_in_reasoning=state.prompt_in_reasoning,
            embedding=out.embedding,
        )

    def _logprobs(self, out: TokenOutput) -> list[TokenLogprob] | None:
        if out.logprobs is None:
            return None
        tops = out.top_logprobs or [[] for _ in out.token_ids]
        return [self._entry(token, logprob, top) for token, logprob, top in zip(out.token_ids, out.logprobs, tops)]

    def _prompt_logprobs(self, out: TokenOutput) -> list[TokenLogprob] | None:
        if out.prompt_token_ids is None or out.prompt_logprobs is None:
            return None
        ids = out.prompt_token_ids
        tops = out.prompt_top_logprobs or [[] for _ in ids[1:]]
        ranks = out.prompt_ranks or [0 for _ in ids[1:]]
        entries = [self._entry(ids[0], None, [])]
        entries += [self._entry(token, logprob, top, rank)
                    for token, logprob, top, rank in zip(ids[1:], out.prompt_logprobs, tops, ranks)]
        return entries

    def _entry(self, token_id: int, logprob: float | None, top: list[tuple[int, float]], rank: int = 0) -> TokenLogprob:
        text, raw = self._text_of(token_id)
        return TokenLogprob(text, logprob, [(*self._text_of(t), v) for t, v in top], raw, token_id, [t for t, _ in top],
                            rank)

    def _text_of(self, token_id: int) -> tuple[str, bytes]:
        """A single token's text, as OpenAI's logprobs show it (special tokens included), and its bytes."""
        known = self._token_text.get(token_id)
        if known is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            known = self._token_text[token_id] = (text, token_bytes(self._tokenizer, token_id, text))
        return known

    def _forget(self, rid: int) -> None:
        del self._states[rid]
        self._finished[rid] = None
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)

    def _drop_old_orphans(self) -> None:
        now = self._clock()
        for rid in [r for r, o in self._orphans.items() if now - o.since > ORPHAN_TIMEOUT_S]:
            logger.warning("dropping tokens of request %d: it was never registered", rid)
            del self._orphans[rid]


def run_detokenizer(model_dir: str, endpoints: Endpoints, ack_queue: multiprocessing.Queue, heartbeat=None) -> None:
    manager = DetokenizerManager(load_tokenizer(model_dir))
    ctx = zmq.Context()
    inbox: Receiver[DetokenizerInput] = Receiver(ctx, endpoints.detokenizer, DetokenizerInput, bind=True)
    to_api = Sender(ctx, endpoints.api)
    to_scheduler = Sender(ctx, endpoints.scheduler)
    ack_queue.put("detokenizer ready")

    def handle(msg: DetokenizeRegister | BatchTokenOutput) -> None:
        result = manager.register(msg) if isinstance(msg, DetokenizeRegister) else manager.on_batch(msg)
        for abort in result.aborts:
            to_scheduler.send(abort)
        if result.api is not None:
            to_api.send(result.api)

    try:
        inbox.serve(handle, heartbeat)
    finally:
        ctx.destroy(linger=0)
