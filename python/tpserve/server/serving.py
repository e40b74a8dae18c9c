"""Running one chat or text completion call: submit, then answer as JSON or as an SSE stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tpserve.message.frontend import ApiOutput, TokenizeRequest
from tpserve.parsers.chat_output import ChatOutputConfig
from tpserve.parsers.constraints import named_tool
from tpserve.sampling_params import SEED_LIMIT, SamplingParams
from tpserve.server.errors import APIError, error_body
from tpserve.server.formats import SSE_DONE, ChatFormat, CompletionFormat, ResponseFormat, sse
from tpserve.server.client import FrontendClient
from tpserve.server.generation import Choice, ClientGone, Generation
from tpserve.server.limits import RequestLimits
from tpserve.server.metrics import ServerMetrics
from tpserve.server.protocol import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class Serving:
    frontend: FrontendClient
    metrics: ServerMetrics
    model_name: str
    limits: RequestLimits
    aliases: tuple[str, ...] = ()  # more names the model answers to (--served-model-name A B)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    request_timeout: float | None = None  # seconds; None: no limit

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.aliases:
            raise APIError.model_not_found(model)

    def chat_output(self, body: ChatCompletionRequest, constrained: bool) -> ChatOutputConfig:
        """How to split this request's output into reasoning, content and tool calls."""
        wants_tools = bool(body.tools) and body.tool_choice != "none"
        if wants_tools and not body.forced_tool and self.tool_call_parser is None:
            raise APIError.invalid(
                "tools with tool_choice \"auto\" need the server started with --tool-call-parser "
                "(this model's chat template does not show which format it uses)", "tools",
            )
        return ChatOutputConfig(
            reasoning=self.reasoning_parser is not None and body.separate_reasoning,
            constrained=constrained,
            tool_parser=self.tool_call_parser if wants_tools and not body.forced_tool else None,
            forced_tools=body.forced_tool,
            forced_function=named_tool(body.tool_choice),  # checked by body.structure()
        )

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        body.check()
        structure = body.structure()
        params = body.sampling_params(body.effective_max_tokens, structure)
        output = self.chat_output(body, constrained=structure is not None)
        self.limits.check_sequences(1, body.n)
        messages = body.template_messages()
        self.limits.check_text(sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)), "messages")
        reqs = [
            TokenizeRequest(
                rid=self.frontend.new_rid(),
                params=choice_params,
                messages=messages,
                chat_template_kwargs=body.chat_template_kwargs,
                add_generation_prompt=body.add_generation_prompt,
                skip_special_tokens=body.skip_special_tokens,
                tools=body.tools or None,
            )
            for choice_params in _per_choice(params, body.n)
        ]
        fmt = ChatFormat(self.model_name, body.include_usage, logprobs=params.logprobs is not None, output=output)
        return await self._run(reqs, fmt, body.stream, request, body.n)

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        body.check()
        params = body.sampling_params(body.max_tokens, body.structure())
        reqs = []
        prompts = body.prompts()
        self.limits.check_sequences(len(prompts), body.n)
        for prompt in prompts:
            if isinstance(prompt, str):
                self.limits.check_text(len(prompt), "prompt")
            else:
                self.limits.check_ids(len(prompt), "prompt")
        for prompt in prompts:  # choice index = prompt index * n + i, as OpenAI orders them
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            for choice_params in _per_choice(params, body.n):
                reqs.append(TokenizeRequest(rid=self.frontend.new_rid(), params=choice_params, text=text,
                                            input_ids=ids, skip_special_tokens=body.skip_special_tokens))
        fmt = CompletionFormat(self.model_name, body.include_usage, logprobs=params.logprobs is not None)
        return await self._run(reqs, fmt, body.stream, request, body.n)

    async def _run(
        self, reqs: list[TokenizeRequest], fmt: ResponseFormat, stream: bool, request: Request, n: int = 1
    ) -> Response:
        gen = Generation(self.frontend, self.metrics, reqs, choices_per_prompt=n, timeout=self.request_timeout)
        try:  # from the first submit: whatever fails later, nothing this call started keeps running
            await gen.start()
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
            for chunk in fmt.output_chunks(choice, out):
                yield chunk
        while not gen.finished:
            try:
                choice, out = await gen.next()
            except APIError as e:
                failed = True
                yield sse(error_body(e.message, e.type, e.param, e.code))
                break
            for chunk in fmt.output_chunks(choice, out):
                yield chunk
        if fmt.include_usage and not failed:
            yield fmt.usage_chunk(gen.usage())
        yield SSE_DONE
    finally:
        if not gen.finished:
            await gen.abort(client_gone=not failed)
