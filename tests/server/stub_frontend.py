"""An in-process stand-in for FrontendClient: answers each request with a scripted output, so
the HTTP layer can be tested without any backend process."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import numpy as np

from tpserve.message.frontend import ApiOutput, RequestRejected, TokenizeRequest, TokenLogprob


class StubFrontend:
    """Each prompt's "completion" is ``reply`` split into ``pieces`` outputs (one token each:
    with logprobs asked, the piece is the token, of log-probability -1, its alternatives -2, -3, ...).

    A prompt text containing "REJECT" is rejected like an over-long prompt.
    """

    def __init__(
        self, reply: str = "Hello 你好!", pieces: int = 3, prompt_tokens: int = 5, finish: str = "length",
        prompt_in_reasoning: bool | None = None, classes: int = 3,
    ) -> None:
        self.reply = reply
        self.pieces = pieces
        self.prompt_tokens = prompt_tokens
        self.finish = finish
        self.prompt_in_reasoning = prompt_in_reasoning
        self.classes = classes  # a classify request's logits: stub_logits(rid, classes)
        self.submitted: list[TokenizeRequest] = []
        self.aborted: list[int] = []
        self.flushes = 0
        self._rids = itertools.count(1)

    def new_rid(self) -> int:
        return next(self._rids)

    async def submit(self, requests, queue) -> None:
        requests = [choice for req in requests for choice in _choices(req)]
        self.submitted.extend(requests)
        for req in requests:
            asyncio.get_running_loop().create_task(self._answer(req, queue))

    async def _answer(self, req: TokenizeRequest, queue) -> None:
        await asyncio.sleep(0)
        if req.text is not None and "REJECT" in req.text:
            queue.put_nowait(RequestRejected(rid=req.rid, message="the prompt is too long", param=req.prompt_param))
            return
        if req.params.pooled:  # the hidden state [rid, 1, 2, 3] (EMBEDDING_SIZE values), or a classifier's logits
            values = [req.rid, 1, 2, 3] if req.params.pooling == "embed" else stub_logits(req.rid, self.classes)
            vector = np.array(values, dtype="<f4").tobytes()
            queue.put_nowait(ApiOutput(rid=req.rid, text="", new_tokens=0, completion_tokens=0,
                                       prompt_tokens=self.prompt_tokens, finish_reason="stop", embedding=vector))
            return
        size = -(-len(self.reply) // self.pieces)
        chunks = [self.reply[i : i + size] for i in range(0, len(self.reply), size)]
        for i, text in enumerate(chunks):
            last = i == len(chunks) - 1
            queue.put_nowait(
                ApiOutput(
                    rid=req.rid, text=text, new_tokens=1, completion_tokens=i + 1,
                    prompt_tokens=self.prompt_tokens, cached_tokens=0,
                    finish_reason=self.finish if last else None,
                    prompt_in_reasoning=self.prompt_in_reasoning,
                    matched_stop=7 if last and self.finish == "stop" else None,
                    logprobs=None if req.params.logprobs is None else [_logprob(text, req.params.logprobs)],
                )
            )
            await asyncio.sleep(0)

    async def abort(self, rid: int) -> None:
        self.aborted.append(rid)

    async def flush_cache(self) -> None:
        self.flushes += 1


def _choices(req: TokenizeRequest) -> list[TokenizeRequest]:
    """A request with ``more_choices`` as one request per choice (what the tokenizer worker sends on)."""
    return [msgspec.structs.replace(req, more_choices=[]), *(
        msgspec.structs.replace(req, rid=rid, params=msgspec.structs.replace(req.params, seed=seed), more_choices=[])
        for rid, seed in req.more_choices)]


def stub_logits(rid: int, classes: int) -> list[float]:
    """The stub classifier's logits for request ``rid``: the class rid % classes is the most likely, and the logits
    differ from one request to the next (a one-class model's too)."""
    return [(2.0 if c == rid % classes else 0.0) - 0.25 * c + 0.1 * (rid % 7) for c in range(classes)]


def _logprob(token: str, top: int) -> TokenLogprob:
    """Token ids: the piece's first character's code point, the alternatives' 1000 + i."""
    alternatives = [(f"{token}~{i}", f"{token}~{i}".encode(), -2.0 - i) for i in range(top)]
    return TokenLogprob(token, -1.0, alternatives, token.encode(), ord(token[0]) if token else 0,
                        [1000 + i for i in range(top)])
