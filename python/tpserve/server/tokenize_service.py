"""/tokenize and /detokenize in the API server, and a chat prompt's token count (for the Responses API's
``truncation: "auto"``): the model's tokenizer, loaded on first use, run off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from tpserve.message.frontend import TokenizeRequest
from tpserve.sampling_params import SamplingParams
from tpserve.server.errors import APIError
from tpserve.server.limits import RequestLimits
from tpserve.parsers.constraints import template_tools
from tpserve.server.protocol import DetokenizeBody, TokenizeBody, check_request_template
from tpserve.tokenizer.prepare import InvalidRequest, PreparedRequest, PromptLimits, PromptPreparer


class TokenizeService:
    """/tokenize and /detokenize: the model's tokenizer (and chat template) in the API server,
    loaded on first use, run off the event loop. Their inputs have the completion endpoints' size limits."""

    def __init__(self, model_dir: str, chat_template: str | None, limits: RequestLimits,
                 trust_request_chat_template: bool = False,
                 default_template_kwargs: dict[str, Any] | None = None) -> None:
        self._model_dir = model_dir
        self._default_template_kwargs = default_template_kwargs
        self._chat_template = chat_template
        self._limits = limits
        self._trust_request_chat_template = trust_request_chat_template
        self._tokenizer: Any = None
        self._lock = asyncio.Lock()

    async def _load(self) -> Any:
        async with self._lock:
            if self._tokenizer is None:
                from tpserve.tokenizer.loader import load_tokenizer

                self._tokenizer = await asyncio.to_thread(load_tokenizer, self._model_dir, self._chat_template)
        return self._tokenizer

    async def tokenize(self, body: TokenizeBody) -> dict[str, Any]:
        body.check()
        check_request_template(body.chat_template, self._trust_request_chat_template)
        messages = [m.to_template(i) for i, m in enumerate(body.messages or [])]
        if body.prompt is not None:
            self._limits.check_text(len(body.prompt), "prompt")
        else:
            template_kwargs = body.template_kwargs()
            self._limits.check_chat(messages, body.tools, template_kwargs, body.documents)
        if body.prompt is not None:
            tokenizer = await self._load()
            add_special_tokens = body.add_special_tokens is not False
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=add_special_tokens)
        else:
            ids = await self.chat_ids(TokenizeRequest(
                rid=0, params=SamplingParams(), messages=messages,
                chat_template_kwargs=template_kwargs, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tools=template_tools(body.tools), documents=body.documents, chat_template=body.chat_template,
            ), add_special_tokens=body.add_special_tokens is True)
        token_strs = None  # vLLM's response has the key either way
        if body.return_token_strs:
            tokenizer = await self._load()
            token_strs = await asyncio.to_thread(tokenizer.convert_ids_to_tokens, list(ids))
        return {"tokens": list(ids), "count": len(ids), "max_model_len": self._limits.context_len,
                "token_strs": token_strs}

    async def _preparer(self) -> PromptPreparer:
        tokenizer = await self._load()
        return PromptPreparer(tokenizer, PromptLimits(self._limits.context_len, len(tokenizer)),
                              default_template_kwargs=self._default_template_kwargs)

    async def chat_ids(self, req: TokenizeRequest, add_special_tokens: bool = False) -> list[int]:
        """A chat request's prompt tokens, rendered and encoded as the tokenizer worker does (a
        template error: 400); ``add_special_tokens``: with the tokenizer's special tokens on top of the template's."""
        preparer = await self._preparer()
        try:
            ids, _, text = await asyncio.to_thread(preparer.input_ids, req)
        except InvalidRequest as e:
            raise APIError.invalid(e.message, e.param) from e
        if add_special_tokens:
            tokenizer = await self._load()
            ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=True)
        return ids

    async def prepare(self, req: TokenizeRequest) -> PreparedRequest:
        """A request as the tokenizer worker makes it for the scheduler (its refusal: a 400)."""
        preparer = await self._preparer()
        try:
            return await asyncio.to_thread(preparer.prepare, req)
        except InvalidRequest as e:
            raise APIError.invalid(e.message, e.param) from e

    async def eos_token_id(self) -> int | None:
        return (await self._load()).eos_token_id

    async def count_chat(self, req: TokenizeRequest) -> int:
        return len(await self.chat_ids(req))

    async def detokenize(self, body: DetokenizeBody) -> dict[str, Any]:
        self._limits.check_ids(len(body.tokens), "tokens")
        return {"prompt": await self.decode(body.tokens, "tokens")}

    async def decode(self, tokens: list[int], param: str = "prompt", generated: bool = False) -> str:
        """``generated``: tokens the model produced, which may be ids of its vocabulary's padding past the
        tokenizer's (decoded as nothing, as the detokenizer does), not a request's error."""
        tokenizer = await self._load()
        bad = [t for t in tokens if not 0 <= t < len(tokenizer)]
        if bad and not generated:
            raise APIError.invalid(f"token id {bad[0]} is out of range [0, {len(tokenizer)})", param)
        return await asyncio.to_thread(tokenizer.decode, tokens)
