"""POST /v1/embeddings: OpenAI's embeddings API (and vLLM's extensions to it) over the served model.

An input's embedding is the final (normed) hidden state of its last token, L2-normalized: the last-token pooling
of Qwen3-Embedding and of the other decoder-based embedding models. Any served model but a classifier answers; a
generative model's vectors mean what its last hidden state means. The scheduler runs an embedding request as a
prefill whose one sample is never shown (``SamplingParams.pooling``), so it shares batches, chunked prefill and the
prefix cache with generation.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Union

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, StrictInt, StrictStr

from tpserve.message.frontend import TokenizeRequest
from tpserve.pooling import embedding_vector
from tpserve.sampling_params import SamplingParams
from tpserve.server.errors import APIError
from tpserve.server.formats import Choice, ResponseFormat
from tpserve.server.protocol import (
    ChatMessage, _Body, _param_of, check_continuation, check_request_template,
)
from tpserve.server.request_id import request_id
from tpserve.server.serving import Serving

EmbeddingInput = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


@dataclass(frozen=True)
class ChatInput:
    """A conversation pooled as one prompt, rendered by the chat template (vLLM's ``messages`` for embeddings)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str | None
    chat_template_kwargs: dict[str, Any] | None


class PooledInputBody(_Body):
    """The fields the embeddings and classify bodies share: their inputs (texts, token ids, or vLLM's chat
    ``messages``: one conversation, one answer) and vLLM's prompt handling."""

    input: EmbeddingInput | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False  # for messages, as vLLM's embedding chat request
    continue_final_message: bool = False  # for messages
    chat_template: StrictStr | None = None  # for messages (--trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None  # for messages
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: each input's last k tokens only (-1: as many as fit)
    add_special_tokens: bool = True  # vLLM's: texts are tokenized with the tokenizer's special tokens
    cache_salt: StrictStr | None = None  # vLLM's: cached prefixes are shared only with requests of the same salt
    priority: int = 0  # vLLM's: under --schedule-policy priority, lower values are served first

    def inputs(self, trust_request_chat_template: bool) -> list[Labelled]:
        """One labelled entry per answer: a text, a list of token ids, or the conversation."""
        if (self.input is None) == (self.messages is None):
            raise APIError.invalid("give either input or messages", "input")
        if self.messages is not None:
            if not self.messages:
                raise APIError.invalid("messages must not be empty", "messages")
            check_continuation(self.messages, self.add_generation_prompt, self.continue_final_message)
            check_request_template(self.chat_template, trust_request_chat_template)
            messages = [m.to_template(i) for i, m in enumerate(self.messages)]
            return [("messages", ChatInput(messages, self.add_generation_prompt, self.continue_final_message,
                                           self.chat_template, self.chat_template_kwargs))]
        given = self.input
        if isinstance(given, str):
            given = [given]
        elif given and isinstance(given[0], int):
            given = [list(given)]
        if not given:
            raise APIError.invalid("input must not be empty", "input")
        if any(not item for item in given):
            raise APIError.invalid("input must not hold an empty string or an empty token list", "input")
        return [(f"input[{i}]", item) for i, item in enumerate(given)]

    def sampling_params(self, task: str) -> SamplingParams:
        return pooled_params(task, self.truncate_prompt_tokens, self.cache_salt, self.priority)


class EmbeddingRequest(PooledInputBody):
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32, as OpenAI sends them
    dimensions: int | None = Field(default=None, ge=1)  # the first this many values, normalized again (Matryoshka)
    normalize: bool = True  # vLLM's: False returns the hidden state as it is


def pooled_params(
    task: str, truncate_prompt_tokens: int | None, cache_salt: str | None = None, priority: int = 0
) -> SamplingParams:
    """A pooled request's params (``SamplingParams.pooling``), a 400 naming a bad field."""
    try:
        return SamplingParams(pooling=task, max_tokens=1, truncate_prompt_tokens=truncate_prompt_tokens,
                              cache_salt=cache_salt, priority=priority)
    except ValueError as e:
        raise APIError.invalid(str(e), _param_of(str(e))) from e


def check_task(serving: Serving, task: str) -> None:
    """A 400 where the model does not answer pooled requests of ``task`` (a classifier asked to embed, ...)."""
    problem = serving.head.unserved(task)
    if problem is not None:
        raise APIError.invalid(problem, "model")


class EmbeddingFormat(ResponseFormat):
    """The embeddings API's list object, built from each input's hidden state (``Choice.embedding``)."""

    object_name = "list"
    id_prefix = "embd"

    def __init__(self, model: str, body: EmbeddingRequest, labels: list[str], request_id: str | None = None) -> None:
        super().__init__(model, request_id=request_id)
        self.body, self.labels = body, labels

    def response(self, choices: Iterable[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        data = [{"object": "embedding", "index": i, "embedding": self._encoded(raw)}
                for i, raw in enumerate(hidden_states(choices, self.labels))]
        prompt_tokens = usage["prompt_tokens"]
        return {"id": self.id, "object": "list", "created": self.created, "model": self.model, "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}  # vLLM's usage (OpenAI's: its first two)

    def _encoded(self, raw: bytes) -> list[float] | str:
        try:
            vector = embedding_vector(raw, self.body.dimensions, self.body.normalize)
        except ValueError as e:  # dimensions past the hidden size, known once the answers are in
            raise APIError.invalid(str(e), "dimensions") from e
        if self.body.encoding_format == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        return vector.tolist()


# An input to pool: where it came from ("input[2]", "query", "documents[0]": the field before any "["), and a text,
# token ids, a pair of texts tokenized as one (a cross-encoder's) or a conversation
Labelled = tuple[str, Union[str, list[int], tuple[str, str], ChatInput]]


def field_of(label: str) -> str:
    return label.split("[", 1)[0]


def pooled_requests(
    serving: Serving, inputs: list[Labelled], params: SamplingParams, add_special_tokens: bool = True
) -> list[TokenizeRequest]:
    """One backend request per input, checked against the limits (too many: named by the last input's field, the
    list that holds them)."""
    serving.limits.check_sequences(len(inputs), 1, field_of(inputs[-1][0]))
    reqs = []
    for label, item in inputs:
        if isinstance(item, ChatInput):
            serving.limits.check_chat(item.messages, None, item.chat_template_kwargs)
            reqs.append(TokenizeRequest(
                rid=serving.frontend.new_rid(), params=params, messages=item.messages,
                chat_template_kwargs=item.chat_template_kwargs, add_generation_prompt=item.add_generation_prompt,
                continue_final_message=item.continue_final_message, chat_template=item.chat_template))
            continue
        texts = (item,) if isinstance(item, str) else item if isinstance(item, tuple) else None
        if texts is None:
            serving.limits.check_ids(len(item), field_of(label), params.truncate_prompt_tokens is not None)
        else:
            serving.limits.check_text(sum(map(len, texts)), field_of(label))
        reqs.append(TokenizeRequest(
            rid=serving.frontend.new_rid(), params=params, prompt_param=field_of(label),
            add_special_tokens=add_special_tokens, input_ids=item if texts is None else None,
            text=None if texts is None else texts[0], text_pair=texts[1] if texts is not None and len(texts) > 1 else None))
    return reqs


def hidden_states(choices: Iterable[Choice], labels: list[str], done: str = "embedded") -> list[bytes]:
    """Each choice's pooled vector (an embedding, or a classifier's logits), in input order (``labels``: the
    inputs'); a 400 naming one that ended without it (e.g. too long for the whole KV cache: "length") and saying
    what it could not be (``done``)."""
    ordered = sorted(choices, key=lambda c: c.index)
    for c in ordered:
        if c.embedding is None:
            raise APIError.invalid(f"{labels[c.index]} could not be {done} (it ended with {c.finish_reason!r})",
                                   field_of(labels[c.index]))
    return [c.embedding for c in ordered]


async def create_embeddings(serving: Serving, body: EmbeddingRequest, request: Request) -> Response:
    serving.check_model(body.model)
    check_task(serving, "embed")
    hidden = serving.head.hidden_size
    if body.dimensions is not None and hidden is not None and body.dimensions > hidden:
        raise APIError.invalid(f"dimensions must be in [1, {hidden}] (this model's hidden size), got {body.dimensions}",
                               "dimensions")
    inputs = body.inputs(serving.trust_request_chat_template)
    reqs = pooled_requests(serving, inputs, body.sampling_params("embed"), body.add_special_tokens)
    fmt = EmbeddingFormat(serving.model_name, body, [label for label, _ in inputs], request_id(request))
    return await serving.run(reqs, fmt, False, request)
