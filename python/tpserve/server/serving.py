"""Running one chat or text completion call: submit, then answer as JSON or as an SSE stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tpserve.message.frontend import ApiOutput, TokenizeRequest
from tpserve.sampling_params import SamplingParams
from tpserve.server.errors import APIError, error_body
from tpserve.server.formats import SSE_DONE, ChatFormat, CompletionFormat, ResponseFormat, sse
from tpserve.server.client import FrontendClient
from tpserve.server.generation import Choice, ClientGone, Generation
from tpserve.server.metrics import ServerMetrics
from tpserve.server.protocol import SEED_LIMIT, ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class Serving:
    frontend: FrontendClient
    metrics: ServerMetrics
    model_name: str

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError.model_not_found(model)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        body.check()
        params = body.sampling_params(body.effective_max_tokens)
        reqs = [
            TokenizeRequest(
                rid=self.frontend.new_rid(),
                params=choice_params,
                messages=body.template_messages(),
                chat_template_kwargs=body.chat_template_kwargs,
                add_generation_prompt=body.add_generation_prompt,
                skip_special_tokens=body.skip_special_tokens,
            )
            for choice_params in _per_choice(params, body.n)
        ]
        fmt = ChatFormat(self.model_name, body.include_usage, logprobs=params.logprobs is not None)
        return await self._run(reqs, fmt, body.stream, request, body.n)

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        body.check()
        params = body.sampling_params(body.max_tokens)
        reqs = []
        for prompt in body.prompts():  # choice index = prompt index * n + i, as OpenAI orders them
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            for choice_params in _per_choice(params, body.n):
                reqs.append(TokenizeRequest(rid=self.frontend.new_rid(), params=choice_params, text=text,
                                            input_ids=ids, skip_special_tokens=body.skip_special_tokens))
        fmt = CompletionFormat(self.model_name, body.include_usage, logprobs=params.logprobs is not None)
        return await self._run(reqs, fmt, body.stream, request, body.n)

    async def _run(
        self, reqs: list[TokenizeRequest], fmt: ResponseFormat, stream: bool, request: Request, n: int = 1
    ) -> Response:
        gen = Generation(self.frontend, self.metrics, reqs, choices_per_prompt=n)
        await gen.start()
        try:
            if not stream:
                while not gen.finished:
                    await gen.next(request.is_disconnected)
                return JSONResponse(fmt.response(gen))
            # Wait for every prompt's first answer, so a rejection still gets a 4xx status.
            early: list[tuple[Choice, ApiOutput]] = []
            while not gen.all_started:
                early.append(await gen.next(request.is_disconnected))
        except ClientGone:
            await gen.abort(client_gone=True)
            return Response(status_code=499)
        except BaseException:
            await gen.abort()
            raise
        return StreamingResponse(_stream(gen, fmt, early), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n choices of one prompt: with a seed, choice i samples with seed + i (reproducible and
    different); without one, each gets its own random seed downstream."""
    if params.seed is None:
        return [params] * n
    return [msgspec.structs.replace(params, seed=(params.seed + i) % SEED_LIMIT) for i in range(n)]


async def _stream(
    gen: Generation, fmt: ResponseFormat, early: list[tuple[Choice, ApiOutput]]
) -> AsyncIterator[bytes]:
    """SSE body. If the client goes away (the task is cancelled), the rest is aborted."""
    failed = False
    try:
        for choice in sorted(gen.choices.values(), key=lambda c: c.index):
            start = fmt.start_chunk(choice.index)
            if start is not None:
                yield start
        for choice, out in early:
            for chunk in _chunks(fmt, choice, out):
                yield chunk
        while not gen.finished:
            try:
                choice, out = await gen.next()
            except APIError as e:
                failed = True
                yield sse(error_body(e.message, e.type, e.param, e.code))
                break
            for chunk in _chunks(fmt, choice, out):
                yield chunk
        if fmt.include_usage and not failed:
            yield fmt.usage_chunk(gen.usage())
        yield SSE_DONE
    finally:
        if not gen.finished:
            await gen.abort(client_gone=not failed)


def _chunks(fmt: ResponseFormat, choice: Choice, out: ApiOutput) -> list[bytes]:
    chunks = []
    if out.text or (fmt.logprobs and out.logprobs):
        chunks.append(fmt.text_chunk(choice.index, out.text, out.logprobs))
    if out.finish_reason is not None:
        chunks.append(fmt.finish_chunk(choice.index, out.finish_reason))
    return chunks
