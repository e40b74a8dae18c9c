"""OpenAI response objects and stream chunks, for chat and text completions."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from tpserve.message.frontend import TokenLogprob
from tpserve.server.generation import Generation, Usage


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ResponseFormat:
    """Builds one API call's response (or its stream chunks)."""

    object_name: str
    chunk_object_name: str
    id_prefix: str

    def __init__(self, model: str, include_usage: bool = False, logprobs: bool = False) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.logprobs = logprobs  # the request asked for them: "logprobs" is filled, not null

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def chunk(self, choices: list[dict[str, Any]]) -> bytes:
        body = self._envelope(self.chunk_object_name, choices)
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, usage: Usage) -> bytes:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = usage.to_dict()
        return sse(body)

    def response(self, gen: Generation) -> dict[str, Any]:
        choices = [self.full_choice(c.index, "".join(c.text), c.finish_reason, c.logprobs)
                   for c in sorted(gen.choices.values(), key=lambda c: c.index)]
        body = self._envelope(self.object_name, choices)
        body["usage"] = gen.usage().to_dict()
        return body

    # per-kind pieces
    def start_chunk(self, index: int) -> bytes | None:
        return None

    def text_chunk(self, index: int, text: str, logprobs: list[TokenLogprob] | None = None) -> bytes:
        raise NotImplementedError

    def finish_chunk(self, index: int, finish_reason: str) -> bytes:
        raise NotImplementedError

    def full_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        raise NotImplementedError


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _delta(
        self, index: int, delta: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None = None
    ) -> bytes:
        return self.chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _token_bytes(e.token),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": _token_bytes(t)} for t, v in e.top],
            }
            for e in entries or []
        ]
        return {"content": content, "refusal": None}

    def start_chunk(self, index: int) -> bytes:
        return self._delta(index, {"role": "assistant", "content": ""}, None)

    def text_chunk(self, index: int, text: str, logprobs: list[TokenLogprob] | None = None) -> bytes:
        return self._delta(index, {"content": text}, None, self._logprobs(logprobs))

    def finish_chunk(self, index: int, finish_reason: str) -> bytes:
        return self._delta(index, {}, finish_reason)

    def full_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason,
        }


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, include_usage: bool = False, logprobs: bool = False) -> None:
        super().__init__(model, include_usage, logprobs)
        self._offsets: dict[int, int] = {}  # per choice: text offset of its next token (streaming)

    def _choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """The legacy completions layout; text offsets count each token's own text."""
        if not self.logprobs:
            return None
        entries = entries or []
        offsets = []
        offset = self._offsets.get(index, 0)
        for e in entries:
            offsets.append(offset)
            offset += len(e.token)
        self._offsets[index] = offset
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries],
            "text_offset": offsets,
        }

    def text_chunk(self, index: int, text: str, logprobs: list[TokenLogprob] | None = None) -> bytes:
        return self.chunk([self._choice(index, text, None, self._logprobs(index, logprobs))])

    def finish_chunk(self, index: int, finish_reason: str) -> bytes:
        return self.chunk([self._choice(index, "", finish_reason)])

    def full_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        return self._choice(index, text, finish_reason, self._logprobs(index, logprobs))
