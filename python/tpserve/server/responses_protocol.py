"""The request bodies of the Responses and Conversations APIs (the agents' endpoints), checked as the chat
bodies in protocol.py are: an unserved field is a 400 naming it."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, StrictInt, StrictStr

from tpserve.sampling_params import MAX_LOGPROBS
from tpserve.server.errors import APIError
from tpserve.server.protocol import _Body

MAX_METADATA_KEYS = 16  # OpenAI's bounds on a response's (or a conversation's) metadata
MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 64, 512


def check_metadata(metadata: dict[str, str] | None) -> None:
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_KEYS:
        raise APIError.invalid(f"metadata may hold at most {MAX_METADATA_KEYS} keys, got {len(metadata)}", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise APIError.invalid(f"metadata keys may have at most {MAX_METADATA_KEY_CHARS} characters and "
                                   f"values at most {MAX_METADATA_VALUE_CHARS}", "metadata")


# Fields of the Responses API that tpserve does not serve: each is a 400 naming it, not ignored.
UNSUPPORTED_RESPONSES_FIELDS = {
    "prompt": "prompt templates are not supported: send input (and instructions)",
    "moderation": "moderation is not served",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not served by the Responses API (its logprobs name "
                                  "tokens by text): use /v1/chat/completions",
    "prompt_logprobs": "prompt_logprobs is not served by the Responses API: use /v1/chat/completions",
    "use_beam_search": "use_beam_search is not served by the Responses API: use /v1/chat/completions",
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include values accepted: the output text's logprobs; encrypted reasoning (asked by agents with store: false)
# is ignored, the reasoning comes as text
RESPONSES_INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")


class ResponsesRequest(_Body):
    """POST /v1/responses (OpenAI's Responses API). ``server/responses.py`` serves it as a chat
    request; chat's sampling extensions (seed, top_k, ignore_eos, ...) ride along as extra fields."""

    model: str | None = None
    input: Union[StrictStr, list[dict[str, Any]]] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Union[StrictStr, dict[str, Any]] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    conversation: Union[StrictStr, dict[str, Any]] | None = None  # an id, or {"id": ...}
    metadata: dict[str, StrictStr] | None = None
    user: str | None = None
    # echoed in the response, as OpenAI does; tpserve's prefix cache needs no key and has no safety system
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    background: bool = False
    truncation: Literal["auto", "disabled"] = "disabled"  # auto: server/truncation.py
    # OpenAI's bound on calls to built-in tools, which tpserve does not serve: function calls are not
    # counted (nor by OpenAI), so it has no effect
    max_tool_calls: StrictInt | None = Field(default=None, ge=0)
    include: list[StrictStr] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # with include's logprobs

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    @property
    def conversation_id(self) -> str | None:
        """The id ``conversation`` names (checked by ``check``)."""
        conversation = self.conversation
        return conversation.get("id") if isinstance(conversation, dict) else conversation

    def check(self) -> None:
        self.refuse_unserved(UNSUPPORTED_RESPONSES_FIELDS)
        if self.background and not self.store:
            raise APIError.invalid("background responses must be stored: send store: true", "background")
        for item in self.include or []:
            if item not in RESPONSES_INCLUDES:
                raise APIError.invalid(f"include {item!r} is not supported (only {', '.join(RESPONSES_INCLUDES)})",
                                       "include")
        if self.conversation is not None:
            if not isinstance(self.conversation_id, str) or not self.conversation_id:
                raise APIError.invalid('conversation must be a conversation id or {"id": "conv_..."}', "conversation")
            if self.previous_response_id is not None:
                raise APIError.invalid("Mutually exclusive parameters: Ensure you are only providing one of: "
                                       "'previous_response_id' or 'conversation'.", "conversation")
        continued = self.previous_response_id is not None or self.conversation is not None
        if isinstance(self.input, list) and not self.input and not continued:
            raise APIError.invalid("input must not be empty", "input")
        check_metadata(self.metadata)


class ConversationCreateBody(_Body):
    """POST /v1/conversations (``server/conversations.py``)."""

    items: list[dict[str, Any]] = Field(default_factory=list)
    metadata: dict[StrictStr, StrictStr] | None = None


class ConversationUpdateBody(_Body):
    """POST /v1/conversations/{id}: the new metadata (it replaces the old; null or {} clears it)."""

    metadata: dict[StrictStr, StrictStr] = Field(default_factory=dict)


class ConversationItemsBody(_Body):
    """POST /v1/conversations/{id}/items."""

    items: list[dict[str, Any]]
