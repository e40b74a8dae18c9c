"""OpenAI response objects and stream chunks, for chat and text completions."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from tpserve.server.generation import Generation, Usage


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ResponseFormat:
    """Builds one API call's response (or its stream chunks)."""

    object_name: str
    chunk_object_name: str
    id_prefix: str

    def __init__(self, model: str, include_usage: bool = False) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

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
        choices = [self.full_choice(c.index, "".join(c.text), c.finish_reason)
                   for c in sorted(gen.choices.values(), key=lambda c: c.index)]
        body = self._envelope(self.object_name, choices)
        body["usage"] = gen.usage().to_dict()
        return body

    # per-kind pieces
    def start_chunk(self, index: int) -> bytes | None:
        return None

    def text_chunk(self, index: int, text: str) -> bytes:
        raise NotImplementedError

    def finish_chunk(self, index: int, finish_reason: str) -> bytes:
        raise NotImplementedError

    def full_choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _delta(self, index: int, delta: dict[str, Any], finish_reason: str | None) -> bytes:
        return self.chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])

    def start_chunk(self, index: int) -> bytes:
        return self._delta(index, {"role": "assistant", "content": ""}, None)

    def text_chunk(self, index: int, text: str) -> bytes:
        return self._delta(index, {"content": text}, None)

    def finish_chunk(self, index: int, finish_reason: str) -> bytes:
        return self._delta(index, {}, finish_reason)

    def full_choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish_reason,
        }


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def text_chunk(self, index: int, text: str) -> bytes:
        return self.chunk([self._choice(index, text, None)])

    def finish_chunk(self, index: int, finish_reason: str) -> bytes:
        return self.chunk([self._choice(index, "", finish_reason)])

    def full_choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return self._choice(index, text, finish_reason)
