"""OpenAI response objects and stream chunks, for chat and text completions, built from each
choice's progress."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import msgspec

from tpserve.message.frontend import ApiOutput, TokenLogprob
from tpserve.parsers.chat_output import ChatOutputConfig, ChatOutputParser, ReasoningTokens
from tpserve.server.errors import APIError, error_body
from tpserve.server.metrics import RequestTimer


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def legacy_token(text: str, raw: bytes) -> str:
    """A token as the legacy completions logprobs show it (``tokens`` and the ``top_logprobs`` keys),
    following OpenAI's legacy completions: its text, unless its bytes are not UTF-8 on their own (part of
    a multi-byte character, whose text is U+FFFD); then ``bytes:`` and each byte as ``\\xNN``, so that
    such tokens stay apart as keys. (vLLM shows U+FFFD for each; chat logprobs carry ``bytes`` instead.)"""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


@dataclass
class Choice:
    """Progress of one prompt (one backend rid)."""

    index: int
    rid: int
    timer: RequestTimer
    text: list[str] = field(default_factory=list)
    text_tokens: list[int] = field(default_factory=list)  # the tokens each piece of ``text`` holds
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    streamed_tokens: int = 0  # the completion tokens of the chunks streamed so far
    started: bool = False  # the backend answered at least once
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # asked with echo: one per prompt token
    prompt_in_reasoning: bool | None = None  # the prompt's think block (DetokenizeRegister's)
    matched_stop: int | str | None = None
    embedding: bytes | None = None  # an embedding request's answer (ApiOutput.embedding)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None



class ResponseFormat:
    """Builds one API call's response (or its stream chunks)."""

    object_name: str
    chunk_object_name: str
    id_prefix: str
    shows_output = True  # False: the generated tokens are left out (and not counted as generated)
    prompt_logprobs_per_choice = True  # vLLM's prompt_logprobs on each choice (completions), or on the response (chat)

    def __init__(self, model: str, include_usage: bool = False, logprobs: bool = False,
                 request_id: str | None = None, tokens_as_ids: bool = False) -> None:
        self.id = f"{self.id_prefix}-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.logprobs = logprobs  # the request asked for them: "logprobs" is filled, not null
        self.tokens_as_ids = tokens_as_ids  # logprobs name tokens "token_id:N" (vLLM's return_tokens_as_token_ids)
        # continuous_usage_stats: a choice's usage as streamed so far (by index), which its chunks then carry
        self.usage_so_far: Callable[[int], dict[str, Any]] | None = None
        self.prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: shown, with this many alternatives
        self.stop_token_ids: frozenset[int] = frozenset()  # the request's, which vLLM's stop_reason names

    def stop_fields(self, matched_stop: int | str | None) -> dict[str, Any]:
        """A finished choice's stop: ``matched_stop`` (SGLang's: the stop string, or the EOS or stop token id) and
        vLLM's ``stop_reason`` (the stop string or a ``stop_token_ids`` id; None at EOS or any other end)."""
        named = isinstance(matched_stop, str) or matched_stop in self.stop_token_ids
        return {"matched_stop": matched_stop, "stop_reason": matched_stop if named else None}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def chunk(self, choices: list[dict[str, Any]]) -> bytes:
        body = self._envelope(self.chunk_object_name, choices)
        if self.include_usage:
            body["usage"] = None
            if self.usage_so_far is not None and len(choices) == 1:  # continuous_usage_stats: the choice's so far
                index = choices[0]["index"]
                body["usage"] = self.counted(self.usage_so_far(index), index)
        return sse(body)

    def usage_chunk(self, usage: dict[str, Any]) -> bytes:
        return sse({**self._envelope(self.chunk_object_name, []), "usage": self.counted(usage)})

    def response(self, choices: Iterable[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        ordered = sorted(choices, key=lambda c: c.index)
        bodies = []
        for c in ordered:  # matched_stop: SGLang's extension, the stop that ended it
            body = self.full_choice(c)
            for key, value in self.stop_fields(c.matched_stop).items():
                body.setdefault(key, value)
            if self.prompt_logprobs is not None and self.prompt_logprobs_per_choice:
                body["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt_logprobs, self.prompt_logprobs)
            bodies.append(body)
        response = {**self._envelope(self.object_name, bodies), "usage": self.counted(usage)}
        if self.prompt_logprobs is not None and not self.prompt_logprobs_per_choice:  # one prompt: the first's
            response["prompt_logprobs"] = vllm_prompt_logprobs(ordered[0].prompt_logprobs, self.prompt_logprobs)
        return response

    def counted(self, usage: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        """The usage as the response shows it (``index``: one choice's, streamed with continuous_usage_stats)."""
        return usage

    def start_chunk(self, index: int) -> bytes | None:
        return None

    def error_chunk(self, error: APIError) -> bytes:
        """The event that tells a streaming client the call failed after its stream began."""
        return sse(error_body(error.message, error.type, error.param, error.code))

    def end_chunks(self, usage: dict[str, Any], failed: bool) -> list[bytes]:
        """What closes the stream, once every choice has finished (or one failed)."""
        usage_chunks = [self.usage_chunk(usage)] if self.include_usage and not failed else []
        return [*usage_chunks, SSE_DONE]

    def output_chunks(self, choice: Choice, out: ApiOutput) -> list[bytes]:
        """The stream chunks of one backend output: its text, then its finish if it is the last."""
        raise NotImplementedError

    def full_choice(self, choice: Choice) -> dict[str, Any]:
        """One finished choice of the non-streamed response."""
        raise NotImplementedError


def vllm_prompt_logprobs(entries: list[TokenLogprob] | None, top: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, then {token id: {logprob, rank,
    decoded_token}} of the token itself and the ``top`` most likely ones (ranked 1..top)."""
    shown: list[dict[str, Any] | None] = []
    for e in entries or []:
        if e.logprob is None:
            shown.append(None)
            continue
        ranked = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}}
        for rank, ((text, _, logprob), token_id) in enumerate(zip(e.top[:top], e.top_ids[:top]), start=1):
            ranked.setdefault(str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": text})
        shown.append(ranked)
    return shown


def chat_logprobs(entries: list[TokenLogprob] | None, tokens_as_ids: bool = False) -> list[dict[str, Any]]:
    """Tokens' log-probabilities as chat's ``logprobs.content`` lists them (and the Responses API's
    ``output_text`` parts); ``tokens_as_ids``: each token named ``token_id:N``."""
    return [
        {
            "token": f"token_id:{e.token_id}" if tokens_as_ids else e.token,
            "logprob": e.logprob,
            "bytes": list(e.raw),
            "top_logprobs": [{"token": f"token_id:{i}" if tokens_as_ids else t, "logprob": v, "bytes": list(raw)}
                             for (t, raw, v), i in zip(e.top, e.top_ids)],
        }
        for e in entries or []
    ]


class ChatFormat(ResponseFormat):
    """Chat responses; ``output`` says whether to split out reasoning and tool calls."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    prompt_logprobs_per_choice = False

    def __init__(
        self, model: str, include_usage: bool = False, logprobs: bool = False, output: ChatOutputConfig | None = None,
        request_id: str | None = None, echo: str = "", tokens_as_ids: bool = False,
    ) -> None:
        super().__init__(model, include_usage, logprobs, request_id, tokens_as_ids)
        self.output = output or ChatOutputConfig()
        self.echo = echo  # the text every choice's content starts with (chat's echo)
        self._parsers: dict[int, ChatOutputParser] = {}  # per choice, while streaming
        self._reasoning: dict[int, ReasoningTokens] = {}  # per choice

    def _parser(self, prompt_in_reasoning: bool | None) -> ChatOutputParser:
        return ChatOutputParser(replace(self.output, starts_in_reasoning=prompt_in_reasoning))

    def _delta(self, index: int, delta: dict[str, Any], finish_reason: str | None,
               logprobs: dict[str, Any] | None = None, matched_stop: int | str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice.update(self.stop_fields(matched_stop))
        return self.chunk([choice])

    def start_chunk(self, index: int) -> bytes:
        return self._delta(index, {"role": "assistant", "content": self.echo}, None)

    def output_chunks(self, choice: Choice, out: ApiOutput) -> list[bytes]:
        parser = self._parsers.get(choice.index)
        if parser is None:
            parser = self._parsers[choice.index] = self._parser(out.prompt_in_reasoning)
        final = out.finish_reason is not None
        parsed = parser.feed(out.text, final)
        reasoning = self._reasoning.setdefault(choice.index, ReasoningTokens())
        reasoning.add(parsed, out.new_tokens, parser.is_reasoning(parsed))
        chunks = []
        if parsed or (self.logprobs and out.logprobs):
            delta: dict[str, Any] = {}
            if parsed.reasoning:
                delta["reasoning_content"] = parsed.reasoning
            if parsed.content or not (parsed.reasoning or parsed.tool_calls):
                delta["content"] = parsed.content
            if parsed.tool_calls:
                delta["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
            chunks.append(self._delta(choice.index, delta, None, self._logprobs(out.logprobs)))
        if final:
            reason = parser.finish_reason(out.finish_reason)
            chunks.append(self._delta(choice.index, {}, reason, matched_stop=out.matched_stop))
        return chunks

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": chat_logprobs(entries, self.tokens_as_ids), "refusal": None}

    def counted(self, usage: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        counts = self._reasoning.values() if index is None else [self._reasoning.get(index, ReasoningTokens())]
        return {**usage, "completion_tokens_details": {"reasoning_tokens": sum(count.count for count in counts)}}

    def _count_reasoning(self, choice: Choice) -> None:
        """The whole response's count: the choice's pieces parsed again one by one, as they were streamed."""
        parser, count = self._parser(choice.prompt_in_reasoning), ReasoningTokens()
        for i, (text, tokens) in enumerate(zip(choice.text, choice.text_tokens)):
            delta = parser.feed(text, final=i == len(choice.text) - 1)
            count.add(delta, tokens, parser.is_reasoning(delta))
        self._reasoning[choice.index] = count

    def full_choice(self, choice: Choice) -> dict[str, Any]:
        if self.output.reasoning:
            self._count_reasoning(choice)
        parser = self._parser(choice.prompt_in_reasoning)
        parsed = parser.feed("".join(choice.text), final=True)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
        if self.output.reasoning:
            message["reasoning_content"] = parsed.reasoning or None
        if parser.tool_calls:
            message["content"] = parsed.content or None
            message["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call in parser.tool_calls
            ]
        if self.echo:
            message["content"] = self.echo + (message["content"] or "")
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice.logprobs),
            "finish_reason": parser.finish_reason(choice.finish_reason),
        }


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(
        self, model: str, include_usage: bool = False, logprobs: bool = False, echo: list[str] | None = None,
        generates: bool = True, request_id: str | None = None, tokens_as_ids: bool = False, echo_top: int = 0,
    ) -> None:
        """``echo_top``: the alternatives the echoed prompt's logprobs show (the request's ``logprobs``)."""
        super().__init__(model, include_usage, logprobs, request_id, tokens_as_ids)
        self._echo_top = echo_top
        self._offsets: dict[int, int] = {}  # per choice: text offset of its next token (streaming)
        self._echo = echo  # per choice: the prompt text its text starts with
        self._echoed: set[int] = set()  # choices whose stream has sent it
        self.shows_output = generates  # False (max_tokens 0 with echo): the generated token is left out

    def counted(self, usage: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        if self.shows_output:
            return usage
        return {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}

    def _choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """The legacy completions layout (tokens shown by ``legacy_token``); text offsets count each
        token's own text, as it is in the choice's text."""
        if not self.logprobs:
            return None
        entries = entries or []
        offsets = []
        offset = self._offsets.get(index, 0)
        for e in entries:
            offsets.append(offset)
            offset += len(e.token)
        self._offsets[index] = offset

        def shown(text: str, raw: bytes, token_id: int) -> str:
            return f"token_id:{token_id}" if self.tokens_as_ids else legacy_token(text, raw)

        def top(e: TokenLogprob) -> dict[str, float] | None:
            """The alternatives, and the token itself where it is none of them: OpenAI's legacy completions
            always show the chosen token's (up to ``logprobs`` + 1 entries; ``logprobs`` 0: that one), as vLLM's."""
            if e.logprob is None:
                return None
            alternatives = {shown(t, raw, i): v for (t, raw, v), i in zip(e.top, e.top_ids)}
            alternatives.setdefault(shown(e.token, e.raw, e.token_id), e.logprob)
            return alternatives

        return {
            "tokens": [shown(e.token, e.raw, e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [top(e) for e in entries],
            "text_offset": offsets,
        }

    def _echoed_text(self, index: int, text: str, entries: list[TokenLogprob] | None,
                prompt_entries: list[TokenLogprob] | None) -> tuple[str, list[TokenLogprob] | None]:
        """``text`` and ``entries`` after the prompt's, with ``echo``."""
        if self._echo is None:
            return text, entries
        prompt_entries = [msgspec.structs.replace(e, top=e.top[:self._echo_top], top_ids=e.top_ids[:self._echo_top])
                          for e in prompt_entries or []]  # prompt_logprobs may have asked for more
        return self._echo[index] + text, prompt_entries + (entries or [])

    def output_chunks(self, choice: Choice, out: ApiOutput) -> list[bytes]:
        chunks = []
        text, entries = (out.text, out.logprobs) if self.shows_output else ("", None)
        if self._echo is not None and choice.index not in self._echoed:  # the first chunk starts with the prompt
            self._echoed.add(choice.index)
            text, entries = self._echoed_text(choice.index, text, entries, out.prompt_logprobs)
        if text or (self.logprobs and entries):
            logprobs = self._logprobs(choice.index, entries)
            chunks.append(self.chunk([self._choice(choice.index, text, None, logprobs)]))
        if out.finish_reason is not None:
            finish = self._choice(choice.index, "", out.finish_reason if self.shows_output else "length")
            finish.update(self.stop_fields(out.matched_stop if self.shows_output else None))
            chunks.append(self.chunk([finish]))
        return chunks

    def full_choice(self, choice: Choice) -> dict[str, Any]:
        text, entries = ("".join(choice.text), choice.logprobs) if self.shows_output else ("", [])
        text, entries = self._echoed_text(choice.index, text, entries, choice.prompt_logprobs)
        if self.shows_output or choice.finish_reason in ("abort", "error"):
            return self._choice(choice.index, text, choice.finish_reason, self._logprobs(choice.index, entries))
        return {**self._choice(choice.index, text, "length", self._logprobs(choice.index, entries)), **self.stop_fields(None)}
