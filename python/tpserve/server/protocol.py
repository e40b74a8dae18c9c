"""OpenAI request bodies (pydantic, validated by FastAPI) and their translation to backend
requests.

Unknown fields are rejected (400) so that a client never silently gets behaviour it did not ask
for. Known OpenAI fields that tpserve does not implement are accepted only at their default
(neutral) value; fields with no effect on the output (``user``, ``metadata``, ...) are ignored.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from tpserve.sampling_params import MAX_LOGPROBS, SamplingParams
from tpserve.server.errors import APIError

MAX_N = 16  # choices per prompt

SEED_LIMIT = 2**63


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # accepted; usage is only sent at the end


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, reasoning_content, ...) are passed on to the chat template.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def to_template(self) -> dict[str, Any]:
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            msg["content"] = "".join(part.text for part in self.content)
        msg.setdefault("content", "")
        if msg["role"] == "developer":  # OpenAI's newer name for the system role
            msg["role"] = "system"
        return msg


class _SamplingFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted only at their neutral value
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None
    # ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def check_common(self) -> None:
        if self.n > MAX_N:
            raise APIError.invalid(f"n must be at most {MAX_N}, got {self.n}", "n")
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise APIError.invalid(f"{name} is not supported (only {neutral})", name)
        if self.logit_bias:
            raise APIError.invalid("logit_bias is not supported", "logit_bias")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise APIError.invalid("seed must be in [0, 2**63)", "seed")
        if self.stream_options is not None and not self.stream:
            raise APIError.invalid("stream_options is only allowed with stream=true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(s == "" for s in stops):
            raise APIError.invalid("stop strings must not be empty", "stop")
        return stops or None

    @property
    def requested_logprobs(self) -> int | None:
        return None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        fields: dict[str, Any] = {
            "max_tokens": max_tokens,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "stop": self.stop_list(),
            "stop_token_ids": list(self.stop_token_ids) if self.stop_token_ids else None,
            "logprobs": self.requested_logprobs,
        }
        for name in ("temperature", "top_p", "top_k", "min_p"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            raise APIError.invalid(str(e)) from e


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None  # ignored (no tools)

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError.invalid(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError.invalid("only response_format {\"type\": \"text\"} is supported", "response_format")
        if self.tools:
            raise APIError.invalid("tools are not supported", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise APIError.invalid("tool_choice is not supported", "tool_choice")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise APIError.invalid("give max_tokens or max_completion_tokens, not both", "max_tokens")

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template() for m in self.messages]


PromptType = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: int | None = Field(default=COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise APIError.invalid("echo is not supported", "echo")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError.invalid(f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
        if self.suffix:
            raise APIError.invalid("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != 1:
            raise APIError.invalid("best_of is not supported (only 1)", "best_of")

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[Union[str, list[int]]]:
        """One entry per choice: a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError.invalid("prompt must not be empty", "prompt")
        if isinstance(p[0], (str, list)):
            if any(isinstance(x, list) and not x for x in p):
                raise APIError.invalid("a token-id prompt must not be empty", "prompt")
            return list(p)
        return [list(p)]  # one prompt of token ids
