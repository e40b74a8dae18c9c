"""/tokenize and /detokenize: the model's tokenizer (and chat template) in the API server,
loaded on first use, run off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from tpserve.message.frontend import TokenizeRequest
from tpserve.sampling_params import SamplingParams
from tpserve.server.errors import APIError
from tpserve.server.protocol import DetokenizeBody, TokenizeBody
from tpserve.tokenizer.prepare import InvalidRequest, PromptLimits, PromptPreparer


class TokenizeService:
    def __init__(self, model_dir: str, chat_template: str | None, context_len: int) -> None:
        self._model_dir = model_dir
        self._chat_template = chat_template
        self._context_len = context_len
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
        tokenizer = await self._load()
        if body.prompt is not None:
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            preparer = PromptPreparer(tokenizer, PromptLimits(self._context_len, len(tokenizer)))
            req = TokenizeRequest(
                rid=0, params=SamplingParams(), messages=[m.to_template(i) for i, m in enumerate(body.messages or [])],
                chat_template_kwargs=body.chat_template_kwargs, add_generation_prompt=body.add_generation_prompt,
                tools=body.tools or None,
            )
            try:
                text = await asyncio.to_thread(preparer.render_chat, req)
            except InvalidRequest as e:
                raise APIError.invalid(e.message, e.param) from e
            ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
        return {"tokens": list(ids), "count": len(ids), "max_model_len": self._context_len}

    async def detokenize(self, body: DetokenizeBody) -> dict[str, Any]:
        tokenizer = await self._load()
        bad = [t for t in body.tokens if not 0 <= t < len(tokenizer)]
        if bad:
            raise APIError.invalid(f"token id {bad[0]} is out of range [0, {len(tokenizer)})", "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}
