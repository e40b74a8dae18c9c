"""Serving.run's stream: outputs that arrived together are written together."""

from __future__ import annotations

import asyncio
import json

from tpserve.message.frontend import ApiOutput, TokenizeRequest
from tpserve.sampling_params import SamplingParams
from tpserve.server.formats import ChatFormat
from tpserve.server.limits import RequestLimits
from tpserve.server.metrics import ServerMetrics
from tpserve.server.serving import Serving


class QueuedFrontend:
    """Every output of a request is on its queue as soon as it is submitted (a server behind its streams)."""

    def __init__(self, texts: list[str], error_at: int | None = None) -> None:
        self.texts, self.error_at = texts, error_at

    def new_rid(self) -> int:
        return 1

    async def submit(self, requests, queue) -> None:
        for i, text in enumerate(self.texts):
            last = i == len(self.texts) - 1
            finish = "error" if i == self.error_at else "length" if last else None
            queue.put_nowait(ApiOutput(rid=requests[0].rid, text=text, new_tokens=1, completion_tokens=i + 1,
                                       prompt_tokens=2, finish_reason=finish, error="bad" if finish == "error" else None))

    async def abort(self, rid: int) -> None:
        pass


def stream_writes(frontend: QueuedFrontend) -> list[bytes]:
    serving = Serving(frontend, ServerMetrics(), "m", RequestLimits(context_len=64, max_sequences=4))  # type: ignore[arg-type]

    async def go() -> list[bytes]:
        fmt = ChatFormat("m")
        response = await serving.run([TokenizeRequest(rid=1, params=SamplingParams())], fmt, True, None)
        return [chunk async for chunk in response.body_iterator]

    return asyncio.run(go())


def events(writes: list[bytes]) -> list[str]:
    return [e for w in writes for e in w.decode().split("\n\n") if e]


def test_outputs_queued_together_go_out_in_one_write():
    writes = stream_writes(QueuedFrontend(["a", "b", "c", "d"]))
    # the role chunk, the first output (awaited before the stream starts), the other three in one write, [DONE]
    assert len(writes) == 4
    contents = [json.loads(e[len("data: "):])["choices"][0]["delta"].get("content") for e in events(writes[2:3])]
    assert contents == ["b", "c", "d", None]  # the last: its finish chunk
    assert writes[-1] == b"data: [DONE]\n\n"


def test_an_error_among_queued_outputs_follows_the_outputs_before_it():
    writes = stream_writes(QueuedFrontend(["a", "b", "c", "d"], error_at=2))
    first, error = [json.loads(e[len("data: "):]) for e in events(writes[2:3])]
    assert first["choices"][0]["delta"]["content"] == "b"
    assert error["error"]["message"] == "bad"
    assert writes[-1] == b"data: [DONE]\n\n"
