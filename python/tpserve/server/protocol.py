"""The chat, completions and /tokenize request bodies (pydantic, validated by FastAPI) and their translation to
backend requests (the Responses and Conversations APIs' bodies: responses_protocol.py).

Lenient where the ecosystem is: unknown fields (vendor extensions such as ``reasoning_effort``)
are accepted and ignored (logged at debug), ``null`` means the default, and content parts may
carry extra keys (``cache_control``). A content part tpserve cannot serve (an image) is a
one-line 400.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Mapping, Union

import msgspec
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from tpserve.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from tpserve.parsers.constraints import FieldError, check_tools, output_structure
from tpserve.sampling_defaults import SAMPLING_FIELDS
from tpserve.sampling_params import MAX_LOGPROBS, SEED_LIMIT, SamplingParams, StructuredOutput
from tpserve.server.chat_messages import assistant_for_template, part_text
from tpserve.server.errors import APIError
from tpserve.server.limits import check_transportable

logger = logging.getLogger(__name__)

MAX_N = 16  # choices per prompt


class _Lenient(BaseModel):
    """Unknown fields are kept aside (``model_extra``) and ``null`` means "the default"."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class _Body(_Lenient):
    """A whole request body: every value must be encodable for the backend (see limits)."""

    @model_validator(mode="before")
    @classmethod
    def _transportable(cls, data: Any) -> Any:
        check_transportable(data)
        return data

    def refuse_unserved(self, unserved: dict[str, str]) -> None:
        """A 400 for the first extra field of ``unserved`` (name -> why) set to ask for its feature: null, false, 0
        and "" ask for nothing."""
        for name, why in unserved.items():
            if (self.model_extra or {}).get(name) not in (None, False, 0, ""):
                raise APIError.invalid(why, name)


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class ChatMessage(_Lenient):
    # Extra keys (name, tool_calls, tool_call_id, reasoning_content, ...) go to the chat template.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[Any], None] = None

    def to_template(self, index: int) -> dict[str, Any]:
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            # as vLLM renders parts for a template that takes a string: one line each (not run together)
            msg["content"] = "\n".join(part_text(p, f"messages[{index}].content", "messages") for p in self.content)
        msg.setdefault("content", "")
        if msg["role"] == "developer":  # OpenAI's newer name for the system role
            msg["role"] = "system"
        if self.role == "tool" and not isinstance(msg.get("tool_call_id"), str):  # required, as OpenAI's
            raise APIError.invalid(f"messages[{index}].tool_call_id (the id of the call it answers) is required for a "
                                   "tool message and must be a string", "messages")
        if msg["role"] == "function":  # the legacy name of a tool result
            msg["role"] = "tool"
        if msg["role"] == "assistant":
            assistant_for_template(msg, index)
        return msg


def _function_name(tool: Any) -> str | None:
    """A chat tool's function name (``{"type": "function", "function": {"name"}}``), or None."""
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def thinking_kwargs(given: dict[str, Any] | None, effort: Any, param: str) -> dict[str, Any] | None:
    """The chat template's kwargs with OpenAI's reasoning effort: "none" switches thinking off (Qwen3's
    ``enable_thinking``), any other effort on, unless ``given`` (chat_template_kwargs) says otherwise."""
    kwargs = dict(given or {})
    if effort is None:
        return kwargs or None
    if effort not in REASONING_EFFORTS:
        raise APIError.invalid(f"{param} must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}", param)
    kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


# vLLM's fields of features tpserve does not serve (chat and completions), when set to ask for them: a 400 naming
# them, not an answer without them
# fields that change what a sampled completion is, and their values that change nothing: a beam search (beams
# ranked by their log-probabilities alone) refuses any other value
BEAM_SEARCH_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (None, 1.0), "top_k": (None, -1, 0), "min_p": (None, 0.0), "stop": (None, "", []),
    "stop_token_ids": (None, []), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
    "repetition_penalty": (None, 1.0), "logit_bias": (None, {}), "allowed_token_ids": (None,), "bad_words": (None, []),
    "min_tokens": (0,), "prompt_logprobs": (None,), "echo": (False,),
}
# chat fields of features tpserve does not serve: a 400 naming them, not an answer without them
UNSERVED_CHAT_FIELDS = {
    "functions": "functions and function_call (deprecated) are not served: use tools and tool_choice",
    "function_call": "functions and function_call (deprecated) are not served: use tools and tool_choice",
    "audio": "audio output is not served (tpserve serves text-only models)",
    "web_search_options": "web search is not served",
}


def check_request_template(template: str | None, trusted: bool) -> None:
    """A request's own chat_template is rendered only by a server started to trust them (as vLLM's)."""
    if template == "":
        raise APIError.invalid("chat_template must not be empty", "chat_template")
    if template is not None and not trusted:
        raise APIError.invalid("a request's own chat_template is refused: start the server with "
                               "--trust-request-chat-template to accept them (or set --chat-template)", "chat_template")


def check_continuation(messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool) -> None:
    """continue_final_message continues the last message: it must be the assistant's, and no new
    turn may be opened after it."""
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise APIError.invalid("continue_final_message needs add_generation_prompt: false", "continue_final_message")
    if not messages or messages[-1].role != "assistant":
        raise APIError.invalid("continue_final_message needs the last message to be the assistant's",
                               "continue_final_message")


class _SamplingFields(_Body):
    """Fields shared by /v1/chat/completions and /v1/completions."""

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
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's: only these tokens may be sampled
    bad_words: list[StrictStr] | None = None  # vLLM's: words the output does not contain (SamplingParams)
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None  # vLLM's: the prompt's last k tokens only (-1: as many as fit)
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    # vLLM's: each prompt token's log-probability and rank, with the k most likely tokens at its position
    prompt_logprobs: int | None = None
    cache_salt: StrictStr | None = None  # vLLM's: cached prefixes are shared only with requests of the same salt
    priority: int = 0  # vLLM's: under --schedule-policy priority, lower values are served first
    use_beam_search: bool = False  # vLLM's: the n choices are the n best beams (tpserve/beam_search.py)
    length_penalty: float = 1.0  # vLLM's, with use_beam_search: beams rank by cum_logprob / length ** length_penalty
    # structured output: OpenAI's response_format, and the vLLM/SGLang extensions
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    # vLLM's: structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}, and its older fields
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: str | None = None  # accepted and ignored: xgrammar compiles every grammar
    # ignored
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def check_common(self) -> None:
        if self.model_extra:
            logger.debug("ignoring unknown request fields: %s", ", ".join(sorted(self.model_extra)))
        if self.n > MAX_N:
            raise APIError.invalid(f"n must be at most {MAX_N}, got {self.n}", "n")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise APIError.invalid("seed must be in [0, 2**63)", "seed")
        if self.stream_options is not None and not self.stream:
            raise APIError.invalid("stream_options is only allowed with stream=true", "stream_options")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:  # vLLM's -1 (the whole vocabulary) too
                raise APIError.invalid(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]", "prompt_logprobs")
            if self.stream:  # as vLLM refuses it
                raise APIError.invalid("prompt_logprobs is not available with stream=true", "prompt_logprobs")

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

    def logit_bias_ids(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        # ASCII digits only: int() also reads " 10 ", "1_0" and other scripts' digits
        bad = next((token for token in self.logit_bias if not (token.isascii() and token.isdigit())), None)
        if bad is not None:
            raise APIError.invalid(f"logit_bias keys must be token ids (decimal digits), got {bad!r}", "logit_bias")
        return {int(token): float(bias) for token, bias in self.logit_bias.items()}

    def structure(self) -> StructuredOutput | None:
        """The grammar the output must follow (response_format, regex, ebnf, or a chat's forced
        tool calls), if any."""
        try:
            return output_structure(self.response_format, self.regex, self.ebnf, *self.tool_fields(),
                                    vllm_specs=self.vllm_structured_outputs())
        except FieldError as e:
            raise APIError.invalid(e.message, e.param) from e

    def vllm_structured_outputs(self) -> dict[str, Any]:
        """vLLM's constraint fields given, each as a structured_outputs object: guided_choice is {"choice": ...}."""
        specs = {"structured_outputs": self.structured_outputs} if self.structured_outputs is not None else {}
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                specs[f"guided_{kind}"] = {kind: value}
        return specs

    def tool_fields(self) -> tuple[Any, ...]:
        return ()

    @property
    def structured_param(self) -> str:
        """The field the output's constraint comes from (one at most: ``structure`` checks)."""
        if self.regex is not None:
            return "regex"
        if self.ebnf is not None:
            return "ebnf"
        return next(iter(self.vllm_structured_outputs()), "response_format")

    def beam_search_params(self, params: SamplingParams, structured_param: str) -> BeamSearchParams | None:
        """With use_beam_search, the search's params (``params``: this body's sampling params); fields a beam search
        does not apply are a 400 naming them, not ignored."""
        if not self.use_beam_search:
            return None
        for name, neutral in BEAM_SEARCH_NEUTRAL.items():
            if getattr(self, name, None) not in neutral:
                raise APIError.invalid(f"use_beam_search does not take {name}: beams are ranked by their "
                                       "log-probabilities alone", name)
        if params.structured is not None:
            raise APIError.invalid("use_beam_search does not take structured output", structured_param)
        if self.n > MAX_BEAM_WIDTH:
            raise APIError.invalid(f"n, the beam width, must be at most {MAX_BEAM_WIDTH} with use_beam_search", "n")
        try:
            return BeamSearchParams(beam_width=self.n, max_tokens=params.max_tokens or 1, ignore_eos=self.ignore_eos,
                                    temperature=params.temperature, length_penalty=self.length_penalty,
                                    include_stop_str_in_output=self.include_stop_str_in_output)
        except ValueError as e:
            raise APIError.invalid(str(e), _param_of(str(e))) from e

    def sampling_params(
        self, max_tokens: int | None, structured: StructuredOutput | None = None, defaults: Mapping[str, Any] = {},
    ) -> SamplingParams:
        """``defaults``: the model's sampling defaults (``--generation-config``), for the fields the body leaves
        unset."""
        fields: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "stop": self.stop_list(),
            "stop_token_ids": list(self.stop_token_ids) if self.stop_token_ids else None,
            "logprobs": self.requested_logprobs,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias_ids(),
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
            "min_tokens": self.min_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "prompt_logprobs": self.prompt_logprobs,
            "cache_salt": self.cache_salt,
            "priority": self.priority,
            "skip_special_tokens": self.skip_special_tokens,
            "structured": structured,
        }
        for name in SAMPLING_FIELDS:
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                fields[name] = value
        if (cap := defaults.get("max_tokens")) is not None:  # generation_config's max_new_tokens caps all, as vLLM's
            fields["max_tokens"] = cap if max_tokens is None else min(max_tokens, cap)
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            raise APIError.invalid(str(e), _param_of(str(e))) from e


def narrow_to_allowed_tools(tools: list[dict[str, Any]] | None, choice: Any) -> tuple[list[dict[str, Any]] | None, Any]:
    """OpenAI's ``{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}``: only the listed tools may be
    called. Served as ``tools`` cut to those and ``tool_choice`` its mode (so the prompt shows those only)."""
    if not (isinstance(choice, dict) and choice.get("type") == "allowed_tools"):
        return tools, choice
    try:
        known = check_tools(tools)  # every tool given, as without allowed_tools (and as /tokenize checks them)
    except FieldError as e:
        raise APIError.invalid(e.message, e.param) from e
    spec = choice.get("allowed_tools")
    usage = ('tool_choice allowed_tools must be {"type": "allowed_tools", "allowed_tools": {"mode": "auto" or '
             '"required", "tools": [{"type": "function", "function": {"name": ...}}, ...]}}')
    if not isinstance(spec, dict) or spec.get("mode", "auto") not in ("auto", "required") \
            or not isinstance(spec.get("tools"), list) or not spec["tools"]:
        raise APIError.invalid(usage, "tool_choice")
    names = [_function_name(tool) for tool in spec["tools"]]
    if None in names:
        raise APIError.invalid(usage, "tool_choice")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise APIError.invalid(f"tool_choice allows {unknown[0]!r}, which is not in tools", "tool_choice")
    return [tool for tool in tools or [] if _function_name(tool) in names], spec.get("mode", "auto")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # vLLM's: RAG documents, passed to the chat template
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the model continues the last (assistant) message
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    separate_reasoning: bool = True  # SGLang's: false keeps the thinking in content
    echo: bool = False  # vLLM's: a last assistant message (continue_final_message) leads each choice's content
    chat_template: StrictStr | None = None  # vLLM's: this request's template (--trust-request-chat-template)
    reasoning_effort: str | None = None  # "none" switches thinking off, any other effort on

    def tool_fields(self) -> tuple[Any, ...]:
        return self.tools, self.tool_choice, self.parallel_tool_calls

    @property
    def structured_param(self) -> str:
        return "tools" if self.forced_tool else super().structured_param

    def echoed_text(self) -> str:
        """With ``echo``, the text each choice's content starts with: the last message's, if it is the assistant's."""
        last = self.messages[-1]
        return last.to_template(len(self.messages) - 1)["content"] if self.echo and last.role == "assistant" else ""

    @property
    def forced_tool(self) -> bool:
        """tool_choice "required" or a named function: the output is constrained to calls."""
        return self.tool_choice is not None and self.tool_choice not in ("auto", "none")

    def check(self) -> None:
        """The checks of a chat body; also narrows an ``allowed_tools`` tool_choice to its tools and mode."""
        self.check_common()
        self.tools, self.tool_choice = narrow_to_allowed_tools(self.tools, self.tool_choice)
        self.refuse_unserved(UNSERVED_CHAT_FIELDS)
        modalities = (self.model_extra or {}).get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise APIError.invalid(f"modalities must be [\"text\"] (tpserve serves text-only models), got {modalities!r}",
                                   "modalities")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError.invalid(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise APIError.invalid("give max_tokens or max_completion_tokens, not both", "max_tokens")
        check_continuation(self.messages, self.add_generation_prompt, self.continue_final_message)

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template(i) for i, m in enumerate(self.messages)]

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with ``reasoning_effort`` ("none": thinking off, as Responses' reasoning.effort)."""
        return thinking_kwargs(self.chat_template_kwargs, self.reasoning_effort, "reasoning_effort")


PromptType = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: int | None = Field(default=COMPLETIONS_DEFAULT_MAX_TOKENS, ge=0)  # 0: with echo, score the prompt only
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self.check_common()
        if self.echo and self.truncate_prompt_tokens is not None:
            raise APIError.invalid("echo returns the prompt as sent: it cannot be combined with truncate_prompt_tokens",
                                   "truncate_prompt_tokens")
        if self.max_tokens == 0 and not self.echo:
            raise APIError.invalid("max_tokens 0 needs echo (it returns the prompt and its log-probabilities only)",
                                   "max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError.invalid(f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
        if self.suffix:
            raise APIError.invalid("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != 1:
            raise APIError.invalid("best_of is not supported (only 1)", "best_of")

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def sampling_params(
        self, max_tokens: int | None, structured: StructuredOutput | None = None, defaults: Mapping[str, Any] = {},
    ) -> SamplingParams:
        params = super().sampling_params(max_tokens, structured, defaults)
        if self.echo and self.logprobs is not None:  # the echoed prompt comes with its log-probabilities
            params = msgspec.structs.replace(params, prompt_logprobs=max(self.logprobs, self.prompt_logprobs or 0))
        return params

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


def _param_of(message: str) -> str | None:
    """The field a SamplingParams error message starts with (e.g. "min_tokens must be ...")."""
    first = message.split(" ", 1)[0]
    return first if first.isidentifier() else None


class TokenizeBody(_Body):
    """POST /tokenize: a text ``prompt``, or chat ``messages`` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # the tokenizer's special tokens (e.g. BOS): a prompt's by default; messages' on top of the template's only if
    # true (vLLM's defaults: True for a prompt, False for messages)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True  # for messages
    continue_final_message: bool = False  # for messages
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # as chat's: an allowed_tools choice renders its tools only
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # as chat's
    reasoning_effort: str | None = None  # as chat's: "none" renders the prompt with thinking off
    chat_template: StrictStr | None = None  # as chat's (--trust-request-chat-template)
    return_token_strs: bool = False  # also each token's string (the vocabulary's spelling), as vLLM's token_strs

    def template_kwargs(self) -> dict[str, Any] | None:
        return thinking_kwargs(self.chat_template_kwargs, self.reasoning_effort, "reasoning_effort")

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError.invalid("give either prompt or messages", "prompt")
        check_continuation(self.messages or [], self.add_generation_prompt, self.continue_final_message)
        try:
            check_tools(self.tools)  # as chat checks them: what /tokenize renders is what chat would
        except FieldError as e:
            raise APIError.invalid(e.message, e.param) from e
        self.tools, self.tool_choice = narrow_to_allowed_tools(self.tools, self.tool_choice)


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[StrictInt]
