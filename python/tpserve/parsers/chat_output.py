"""One chat choice's output text, split as the OpenAI API returns it: reasoning, content and
tool calls, streamed or whole."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tpserve.parsers.mistral import MistralParser, Phi4MiniJsonParser
from tpserve.parsers.pythonic import PythonicParser
from tpserve.parsers.qwen3_coder import Qwen3CoderParser
from tpserve.parsers.reasoning import create_reasoning_parser
from tpserve.parsers.tool_calls import (
    TOOL_CALL_PARSERS,
    ForcedToolCalls,
    GraniteParser,
    HermesParser,
    Llama3JsonParser,
    ToolCallDelta,
    ToolCallParser,
    merge_deltas,
)


def create_tool_parser(name: str, tool_params: Mapping[str, Mapping[str, Any]] | None = None) -> ToolCallParser:
    """The ``--tool-call-parser`` named ``name``; ``tool_params``: each function's parameter schemas, for the parsers
    that type text values (qwen3_coder)."""
    if name == "hermes":
        return HermesParser()
    if name == "qwen3_coder":
        return Qwen3CoderParser(tool_params)
    if name == "llama3_json":
        return Llama3JsonParser()
    if name == "mistral":
        return MistralParser()
    if name == "pythonic":
        return PythonicParser()
    if name == "granite":
        return GraniteParser()
    if name == "phi4_mini_json":
        return Phi4MiniJsonParser()
    raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(TOOL_CALL_PARSERS)}")


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass(frozen=True)
class ChatOutputConfig:
    """What to look for in a request's output."""

    reasoning: bool = False  # a reasoning parser is on
    reasoning_parser: str | None = None  # which (--reasoning-parser; None: the <think> one)
    starts_in_reasoning: bool | None = None  # the prompt's think block: open, closed, none (None)
    # A grammar constrains the output: a think block is only one if the output writes <think>
    # (a JSON answer is never reasoning, whatever state the prompt left).
    constrained: bool = False
    tool_parser: str | None = None  # --tool-call-parser, when the request has tools (auto)
    forced_tools: bool = False  # tool_choice "required" or named: the output is the calls' JSON
    forced_function: str | None = None  # the named function
    single_call: bool = False  # parallel_tool_calls false: only the first call is returned (a grammar forces it)
    # each function's parameter schemas (its JSON schema's properties), for a parser that types text values
    tool_params: Mapping[str, Mapping[str, Any]] | None = field(default=None, compare=False, hash=False)


class ChatOutputParser:
    def __init__(self, config: ChatOutputConfig) -> None:
        start = config.starts_in_reasoning
        # A constrained answer is reasoning only where it writes <think> itself, even after a block the prompt opened;
        # after one the prompt closed (thinking off) it is all content, as any answer.
        if config.constrained and start:
            start = None

        self._single_call = config.single_call
        self._reasoning = create_reasoning_parser(config.reasoning_parser, start) if config.reasoning else None
        self._tools: ToolCallParser | None = None
        if config.forced_tools:
            self._tools = ForcedToolCalls(config.forced_function)
        elif config.tool_parser is not None:
            self._tools = create_tool_parser(config.tool_parser, config.tool_params)

    @property
    def tool_calls(self) -> list[ToolCallDelta]:
        """Every call so far, whole (id, name, all its arguments)."""
        calls = self._tools.calls if self._tools is not None else []
        return calls[:1] if self._single_call else calls

    @property
    def in_reasoning(self) -> bool:
        """The output is inside its think block (or just past its end, before any content)."""
        return self._reasoning is not None and self._reasoning.in_block

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        out = ChatDelta()
        content = text
        if self._reasoning is not None:
            split = self._reasoning.feed(text, final)
            out.reasoning, content = split.reasoning, split.content
        if self._tools is None:
            out.content = content
            return out
        parsed = self._tools.feed(content, final)
        out.content, out.tool_calls = parsed.content, merge_deltas(parsed.calls)
        if self._single_call:
            out.tool_calls = [call for call in out.tool_calls if call.index == 0]
        return out

    def is_reasoning(self, delta: ChatDelta) -> bool:
        """Whether the piece just fed into ``delta`` went to reasoning: into the think block, its tags included."""
        return bool(delta.reasoning) or self.in_reasoning

    def finish_reason(self, reason: str | None) -> str | None:
        """A finish with tool calls is "tool_calls" (OpenAI), unless the output ended inside a call (a stop string
        inside it: its arguments are as written, or the block is content if its JSON never parsed; the reason stays)."""
        # with one call kept, a later call cut short does not matter: the first closed before it began
        cut_at = self._tools.cut_at if self._tools is not None else None
        cut_short = cut_at is not None and not (self._single_call and cut_at > 0)
        if reason == "stop" and self.tool_calls and not cut_short:
            return "tool_calls"
        return reason


@dataclass
class ReasoningTokens:
    """Counts a choice's reasoning tokens (``usage``'s ``reasoning_tokens``) from its pieces as they are parsed:
    those of a piece that went to reasoning, and of the pieces before it that the parser held back (an empty
    delta: a tag's first characters, say), which go with the next text the parser lets out."""

    count: int = 0
    held: int = 0

    def add(self, delta: ChatDelta, tokens: int, reasoning: bool) -> int:
        """A piece of ``tokens`` tokens parsed into ``delta``; returns the tokens (held ones included) of its
        non-reasoning text, 0 where it held the piece back or went to reasoning."""
        tokens, self.held = tokens + self.held, 0
        if reasoning:
            self.count += tokens
            return 0
        if not delta:
            self.held = tokens
            return 0
        return tokens
