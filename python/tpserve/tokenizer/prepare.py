"""Turning a TokenizeRequest into a final GenerateRequest: template, tokenize, validate, seed."""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from tpserve.message import GenerateRequest
from tpserve.message.frontend import DetokenizeRegister, TokenizeRequest
from tpserve.parsers.reasoning import prompt_opens_reasoning
from tpserve.sampling_params import SEED_LIMIT, SamplingParams
from tpserve.structured.grammar import InvalidGrammar, check_spec


# apply_chat_template arguments that chat_template_kwargs must not override.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
    "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "chat_template", "tools", "documents",
})


def with_bad_words_encoded(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """``params`` with its ``bad_words`` added to ``bad_words_token_ids``: each word's token ids as it would
    start the text and, where that tokenizes apart, after a space (vLLM's rule: the spaced form counts when its
    first token differs and its length does not). A word that tokenizes to nothing is a ValueError."""
    if not params.bad_words:
        return params
    sequences = list(params.bad_words_token_ids or [])
    for i, word in enumerate(params.bad_words):
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ValueError(f"bad_words[{i}] ({word!r}) is no token at all for this model's tokenizer")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return msgspec.structs.replace(params, bad_words_token_ids=sequences)


class InvalidRequest(Exception):
    """A request the server refuses (HTTP 400); ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def text_chars(value: Any) -> int:
    """Characters of every string (keys too) in a JSON-like value: what a chat template can render."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def chat_chars(messages: Any, tools: Any, chat_template_kwargs: Any, documents: Any = None) -> dict[str, int]:
    """The characters of each part a chat template renders, by the request field it comes from."""
    return {"messages": text_chars(messages), "tools": text_chars(tools),
            "chat_template_kwargs": text_chars(chat_template_kwargs), "documents": text_chars(documents)}


def prompt_chars(req: TokenizeRequest) -> int:
    """The characters a request's prompt is made from (its text, or everything its chat template
    can render: messages, tools and template variables), before tokenizing."""
    if req.text is not None:
        return len(req.text) + len(req.text_pair or "")
    return sum(chat_chars(req.messages, req.tools, req.chat_template_kwargs, req.documents).values())


@dataclass(frozen=True)
class PromptLimits:
    context_len: int  # prompt + generated tokens
    vocab_size: int  # valid token ids are [0, vocab_size)


@dataclass(frozen=True)
class PreparedRequest:
    generate: GenerateRequest
    register: DetokenizeRegister


def kept_prompt_tokens(params: SamplingParams, context_len: int) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: how many prompt tokens are kept (None: all); -1: as many as ``context_len``
    holds with ``max_tokens`` (or ``min_tokens``, at least one token) after them, or all of it for a pooled request."""
    keep = params.truncate_prompt_tokens
    if keep == -1:
        keep = context_len - (0 if params.pooled else params.max_tokens or max(1, params.min_tokens))
    return keep if keep is not None and keep > 0 else None


def truncated_prompt(ids: list[int], params: SamplingParams, context_len: int) -> list[int]:
    """The prompt's last ``kept_prompt_tokens`` ids."""
    keep = kept_prompt_tokens(params, context_len)
    return ids if keep is None else ids[-keep:]


class PromptPreparer:
    def __init__(
        self, tokenizer: Any, limits: PromptLimits, rng: random.Random | None = None, chat_template: str | None = None,
        default_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """``default_template_kwargs``: --default-chat-template-kwargs, under each request's own."""
        self._tokenizer = tokenizer
        self._limits = limits
        self._rng = rng or random.SystemRandom()
        self._chat_template = chat_template  # renders chats instead of the tokenizer's (LLM.chat's chat_template)
        self._default_template_kwargs = dict(default_template_kwargs or {})

    def prepare(self, req: TokenizeRequest) -> PreparedRequest:
        input_ids, param, chat_text = self.input_ids(req)
        ctx = self._limits.context_len
        input_ids = truncated_prompt(input_ids, req.params, ctx)
        n = len(input_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty", param)
        if n > ctx and req.params.pooled:  # no token follows a pooled input: it may fill the context, as in vLLM
            raise InvalidRequest(f"the input has {n} tokens, but this model's context length is {ctx} tokens", param)
        if n >= ctx and not req.params.pooled:
            raise InvalidRequest(
                f"the prompt has {n} tokens, but this model's context length is {ctx} tokens "
                "(the prompt must leave room for at least one generated token)",
                param,
            )
        params = req.params
        if params.max_tokens is not None and n + params.max_tokens > ctx and not params.pooled:
            raise InvalidRequest(
                f"this model's context length is {ctx} tokens, but {n + params.max_tokens} were "
                f"requested ({n} in the prompt, {params.max_tokens} for the completion); "
                "lower max_tokens or shorten the prompt",
                "max_tokens",
            )
        if params.max_tokens is None and params.min_tokens > ctx - n:
            raise InvalidRequest(
                f"min_tokens ({params.min_tokens}) is more than the {ctx - n} tokens this model's context length "
                f"({ctx}) leaves after the {n}-token prompt",
                "min_tokens",
            )
        for name, ids in params.token_id_fields():
            self._check_ids(ids, name)
        try:
            params = with_bad_words_encoded(params, self._tokenizer)
        except ValueError as e:
            raise InvalidRequest(str(e), "bad_words") from e
        if params.structured is not None:
            try:
                check_spec(params.structured)
            except InvalidGrammar as e:
                raise InvalidRequest(str(e), req.structured_param) from e
        final = msgspec.structs.replace(
            params,
            max_tokens=ctx - n if params.max_tokens is None else params.max_tokens,
            seed=self._rng.randrange(SEED_LIMIT) if params.seed is None else params.seed,
        )
        return PreparedRequest(
            generate=GenerateRequest(rid=req.rid, input_ids=input_ids, params=final),
            register=DetokenizeRegister(
                rid=req.rid,
                stop=list(final.stop or []),
                include_stop=final.include_stop_str_in_output,
                min_tokens=final.min_tokens,
                skip_special_tokens=final.skip_special_tokens,
                prompt_tokens=n,
                prompt_in_reasoning=self._reasoning_state(req, chat_text),
            ),
        )

    def prepare_choices(self, req: TokenizeRequest) -> list[PreparedRequest]:
        """``prepare`` for the request and each of its ``more_choices``, which differ from it only in rid and seed."""
        first = self.prepare(req)
        choices = [first]
        for rid, seed in req.more_choices:
            seed = self._rng.randrange(SEED_LIMIT) if seed is None else seed
            params = msgspec.structs.replace(first.generate.params, seed=seed)
            choices.append(PreparedRequest(msgspec.structs.replace(first.generate, rid=rid, params=params),
                                           msgspec.structs.replace(first.register, rid=rid)))
        return choices

    def input_ids(self, req: TokenizeRequest) -> tuple[list[int], str, str]:
        """(token ids, the request field they came from, the rendered chat prompt or "")."""
        if req.messages is not None:
            text = self.render_chat(req)
            return list(self._tokenizer.encode(text, add_special_tokens=False)), "messages", text
        if req.text is not None:
            keep = None if req.text_pair is None else kept_prompt_tokens(req.params, self._limits.context_len)
            if keep is not None:  # a pair is cut as vLLM cuts it: the longer text first, not the first text's head
                ids = self._tokenizer.encode(req.text, req.text_pair, add_special_tokens=req.add_special_tokens,
                                             truncation="longest_first", max_length=keep)
            else:
                ids = self._tokenizer.encode(req.text, req.text_pair, add_special_tokens=req.add_special_tokens)
            return list(ids), req.prompt_param, ""
        if req.input_ids is not None:
            # ids the tokenizer knows, as vLLM checks them: echo and /detokenize can then render the prompt (the
            # embedding's padding rows past the tokenizer, e.g. Qwen3's 151,669-151,935, are not a prompt's)
            vocab = self._limits.vocab_size if req.model_ids else min(self._limits.vocab_size, len(self._tokenizer))
            self._check_ids(req.input_ids, req.prompt_param, vocab)
            return list(req.input_ids), req.prompt_param, ""
        raise InvalidRequest("the request has no prompt", "prompt")

    def render_chat(self, req: TokenizeRequest) -> str:
        kwargs = self._default_template_kwargs | (req.chat_template_kwargs or {})  # the request's win, as vLLM's
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
        template = req.chat_template or self._chat_template
        if template is None and not getattr(self._tokenizer, "chat_template", None):
            raise InvalidRequest("this model has no chat template: use /v1/completions instead", "messages")
        try:
            return self._tokenizer.apply_chat_template(
                req.messages,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tools=req.tools,
                documents=req.documents,
                **kwargs,
            )
        except Exception as e:  # the template is model code and may raise anything on odd input
            raise InvalidRequest(f"cannot apply the chat template: {e}",
                                 "chat_template" if req.chat_template else "messages") from e

    def _reasoning_state(self, req: TokenizeRequest, chat_text: str) -> bool | None:
        """The think block the prompt leaves the new turn in (``prompt_opens_reasoning``), judged on what the
        template writes after the conversation: the generation prompt, or the final message it continues. A
        ``<think>`` quoted in a message, or a closed block of an earlier turn, is not the new turn's."""
        if prompt_opens_reasoning(chat_text) is None:  # no tag anywhere (most prompts): one render
            return None
        if req.continue_final_message:
            before = msgspec.structs.replace(req, messages=req.messages[:-1], continue_final_message=False,
                                             add_generation_prompt=True)
        else:
            before = msgspec.structs.replace(req, add_generation_prompt=False)
        try:
            shared = os.path.commonprefix([self.render_chat(before), chat_text])
        except InvalidRequest:  # a template that cannot render the shorter conversation
            return prompt_opens_reasoning(chat_text)
        return prompt_opens_reasoning(chat_text[len(shared):])

    def _check_ids(self, ids: list[int], param: str, vocab: int | None = None) -> None:
        vocab = self._limits.vocab_size if vocab is None else vocab
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is out of range [0, {vocab})", param)
