"""What a request may hold, checked before any work is queued.

- Every value must cross the process boundary: integers within msgpack's range (int64 below zero, uint64 above:
  a tool schema's ``"maximum": 18446744073709551615`` passes; each typed field has its own bound),
  finite numbers, strings that are valid Unicode (no lone surrogates, which UTF-8 cannot encode).
  One walk over the raw JSON checks all fields, present and future, instead of a bound per field.
- Size: the body's bytes (``--max-request-bytes``, checked from Content-Length before the body is
  read, so a huge body never reaches the JSON parser), the prompt's characters (``context_len x
  MAX_CHARS_PER_TOKEN``: a longer text cannot fit the context, and tokenizing it would hold a
  tokenizer worker for seconds), and the sequences one call starts (prompts x n).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpserve.server.errors import APIError
from tpserve.tokenizer.prepare import chat_chars

INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # what msgpack carries
# No tokenizer of a supported model has tokens this long on average over a whole prompt.
MAX_CHARS_PER_TOKEN = 32


def _untransportable(item: Any) -> str | None:
    """Why a scalar cannot be encoded for the backend, or None if it can."""
    if isinstance(item, bool):
        return None
    if isinstance(item, int) and not INT_MIN <= item <= INT_MAX:
        return f"integer {item} is outside the 64-bit range (-2**63 to 2**64 - 1)"
    if isinstance(item, float) and not math.isfinite(item):
        return f"{item} is not a finite number"
    if isinstance(item, str) and not item.isascii():
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            return "invalid Unicode (a lone surrogate such as \\ud800)"
    return None


def check_transportable(body: Any) -> None:
    """Raise a 400 for the first value that cannot be encoded for the backend."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, path))
                stack.append((child, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
        elif (problem := _untransportable(item)) is not None:
            raise APIError.invalid(f"{path or 'body'}: {problem}", path or None)


@dataclass(frozen=True)
class RequestLimits:
    context_len: int
    max_sequences: int  # prompts x n in one call

    @property
    def max_prompt_chars(self) -> int:
        return self.context_len * MAX_CHARS_PER_TOKEN

    def check_sequences(self, prompts: int, n: int, param: str = "prompt") -> None:
        """``param``: the field the prompts came from."""
        if prompts * n > self.max_sequences:
            raise APIError.invalid(
                f"{prompts} prompt(s) x n={n} = {prompts * n} sequences exceed this server's limit of "
                f"{self.max_sequences} per request (--max-sequences-per-request)", "n" if n > 1 else param
            )

    def check_text(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise APIError.invalid(
                f"the prompt has {chars} characters: more than the {self.context_len}-token context can "
                f"hold ({self.max_prompt_chars} characters at most)", param
            )

    def check_chat(self, messages: Any, tools: Any, chat_template_kwargs: Any, documents: Any = None) -> None:
        """Everything the chat template renders must fit the character limit; the error names the
        largest part."""
        parts = chat_chars(messages, tools, chat_template_kwargs, documents)
        self.check_text(sum(parts.values()), max(parts, key=lambda name: parts[name]))

    def check_ids(self, count: int, param: str, truncated: bool = False) -> None:
        """``truncated``: the prompt is cut to its last tokens (``truncate_prompt_tokens``) before it is checked
        against the context, so it may hold as many ids as a text may hold characters."""
        if truncated:
            if count > self.max_prompt_chars:
                raise APIError.invalid(f"the prompt has {count} tokens: more than {self.max_prompt_chars}, the most "
                                       "a truncated prompt may hold", param)
            return
        if count > self.context_len:
            raise APIError.invalid(f"the prompt has {count} tokens: more than the context ({self.context_len})", param)


class BodySizeLimit:
    """ASGI middleware: 413 for a body over ``max_bytes``, from Content-Length before reading it, or, when there is
    none (a chunked body), once the body read so far is over it: such a body is read here and handed on whole (an
    error raised while the app reads it would be FastAPI's 400)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit():  # the server reads no more than it says
            if int(length) > self.max_bytes:
                return await self._reject(scope, receive, send)
            return await self.app(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._reject(scope, receive, send)
            if not message.get("more_body", False):
                break
        first: Message | None = {"type": "http.request", "body": bytes(body), "more_body": False}

        async def replay() -> Message:
            nonlocal first
            if first is None:
                return await receive()
            message, first = first, None
            return message

        return await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body larger than {self.max_bytes} bytes (--max-request-bytes)"
        await APIError(413, message, code="request_too_large").response()(scope, receive, send)
