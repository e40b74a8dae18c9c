"""Messages between the frontend processes (API server, tokenizer workers, detokenizer).

The scheduler never sees these; its messages are in ``tpserve.message``.

Flow of one request::

    API server --TokenizeRequest--> tokenizer worker --GenerateRequest--> scheduler rank 0
                                           |
                                           +--DetokenizeRegister--> detokenizer
    scheduler rank 0 --BatchTokenOutput--> detokenizer --ApiOutputBatch--> API server
    tokenizer worker --RequestRejected--> API server      (invalid request: never scheduled)
"""

from __future__ import annotations

from typing import Any

import msgspec

from tpserve.message import BatchTokenOutput, LoRAAnswer, SchedulerStats, Shutdown
from tpserve.sampling_params import SamplingParams


# ---- API server -> tokenizer workers ----
class TokenizeRequest(msgspec.Struct, tag="tokenize", kw_only=True):
    """One prompt to tokenize, validate and schedule.

    Exactly one of ``messages`` (chat), ``text`` or ``input_ids`` is set. ``params.max_tokens``
    may be None (= up to the context limit) and ``params.seed`` None (= pick one); the tokenizer
    worker makes both final before the scheduler sees the request.
    """

    rid: int
    params: SamplingParams
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    input_ids: list[int] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template
    documents: list[dict[str, Any]] | None = None  # rendered by the chat template (vLLM's RAG documents)
    chat_template: str | None = None  # the request's own template (--trust-request-chat-template), else the server's
    structured_param: str = "response_format"  # the field params.structured came from, named if it is invalid
    prompt_param: str = "prompt"  # the field ``text`` or ``input_ids`` came from (``input`` for embeddings)
    add_special_tokens: bool = True  # ``text`` is tokenized with the tokenizer's special tokens (e.g. a BOS)
    text_pair: str | None = None  # with ``text``: the pair's second text, both tokenized as one (a cross-encoder's)
    # n > 1: the prompt's other choices as (rid, seed), each prepared from this one's tokens and params (the prompt
    # is rendered and tokenized once)
    more_choices: list[tuple[int, int | None]] = []
    # ``input_ids`` the model produced (a beam search's steps): ids of the model's vocabulary past the tokenizer's
    # (its padding rows) are taken, as vLLM takes them in any prompt
    model_ids: bool = False

    @property
    def choice_rids(self) -> list[int]:
        return [self.rid, *(rid for rid, _ in self.more_choices)]


TokenizerInput = TokenizeRequest | Shutdown


# ---- tokenizer worker -> detokenizer ----
class DetokenizeRegister(msgspec.Struct, tag="detok_register", kw_only=True):
    """What the detokenizer must know about a request before it can turn its tokens into text.

    Sent before the request reaches the scheduler; outputs that still overtake it are buffered.
    """

    rid: int
    stop: list[str] = []
    include_stop: bool = False  # the stop string stays in the text
    min_tokens: int = 0  # no stop string counts before this many tokens
    skip_special_tokens: bool = True
    prompt_tokens: int = 0
    # the prompt leaves the new turn inside a <think> block (True), after one it closed (False), or neither (None)
    prompt_in_reasoning: bool | None = None


DetokenizerInput = BatchTokenOutput | DetokenizeRegister | Shutdown


# ---- detokenizer / tokenizer worker -> API server ----
class TokenLogprob(msgspec.Struct, array_like=True):
    """One token's text, its log-probability and the most likely alternatives (text, bytes,
    logprob) (a prompt's first token has neither: logprob None). ``raw``: the token's bytes, which a
    token holding part of a multi-byte character has and its text (U+FFFD) has not. ``token_id``,
    ``top_ids``: the token's and the alternatives' ids (vLLM's ``return_tokens_as_token_ids`` shows them)."""

    token: str
    logprob: float | None
    top: list[tuple[str, bytes, float]]
    raw: bytes
    token_id: int = -1
    top_ids: list[int] = msgspec.field(default_factory=list)
    rank: int = 0  # a prompt token's rank in the vocabulary (1: the most likely; 0: not known)


class ApiOutput(msgspec.Struct, kw_only=True):
    """New text of one request. ``completion_tokens`` counts all tokens generated so far.

    finish_reason: None while running, else "stop", "length", "abort" or "error" (then
    ``error`` says why).
    """

    rid: int
    text: str
    new_tokens: int
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token, with the first output, when asked
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    prompt_in_reasoning: bool | None = None
    embedding: bytes | None = None  # a pooled request's answer (``TokenOutput.embedding``)


class ApiOutputBatch(msgspec.Struct, tag="api_outputs", kw_only=True):
    outputs: list[ApiOutput]
    stats: SchedulerStats | None = None
    lora: LoRAAnswer | None = None  # a replica's answer to the API server's LoadLoRA or UnloadLoRA


class RequestRejected(msgspec.Struct, tag="rejected", kw_only=True):
    """The tokenizer worker refused the request (e.g. prompt too long); it was not scheduled."""

    rid: int
    message: str
    param: str | None = None
    status: int = 400  # HTTP status for the API server: 400 invalid request, 500 internal error


ApiInput = ApiOutputBatch | RequestRejected
