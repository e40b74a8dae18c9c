"""Running one chat or text completion call: submit its backend requests (one per prompt and
choice), read their outputs as one stream of events (``Generation``), answer as JSON or as an SSE stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tpserve.beam_search import BeamSearchParams
from tpserve.message.frontend import ApiOutput, TokenizeRequest
from tpserve.parsers.chat_output import ChatOutputConfig
from tpserve.parsers.constraints import named_tool, template_tools, tool_parameters
from tpserve.parsers.tool_calls import NEEDS_SPECIAL_TOKENS
from tpserve.pooling import ModelHead
from tpserve.sampling_params import SamplingParams
from tpserve.server.client import FrontendClient
from tpserve.server.beam_search import BeamGeneration
from tpserve.server.errors import APIError, check_model_name
from tpserve.server.formats import ChatFormat, Choice, CompletionFormat, ResponseFormat
from tpserve.server.generation import ClientGone, Generation
from tpserve.server.lora_updates import ServedAdapters
from tpserve.server.limits import RequestLimits
from tpserve.server.metrics import ServerMetrics
from tpserve.server.protocol import ChatCompletionRequest, CompletionRequest, check_request_template
from tpserve.server.request_id import request_id
from tpserve.server.tokenize_service import TokenizeService


@dataclass(frozen=True)
class Serving:
    frontend: FrontendClient
    metrics: ServerMetrics
    model_name: str
    limits: RequestLimits
    aliases: tuple[str, ...] = ()  # more names the model answers to (--served-model-name A B)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False  # vLLM's flag: tool_choice "none" renders no tools
    request_timeout: float | None = None  # seconds; None: no limit
    # for the sampling fields a request leaves unset (--generation-config)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    trust_request_chat_template: bool = False  # a request's own chat_template is rendered (else a 400)
    head: ModelHead = ModelHead()  # what pooled requests get back: embeddings, or a classifier's class logits
    tokens_as_ids: bool = False  # vLLM's --return-tokens-as-token-ids: every request's logprobs name "token_id:N"
    force_include_usage: bool = False  # vLLM's --enable-force-include-usage: every stream ends with its usage
    priority_scheduling: bool = False  # --schedule-policy priority: requests may give a priority other than 0
    prompts: TokenizeService | None = None  # the tokenizer in this process: a beam search's prompts and beams' text
    # LoRA adapters' names (--lora-modules, and those loaded at run time: a ServedAdapters): a generation request may
    # name one
    lora_adapters: ServedAdapters = field(default_factory=ServedAdapters)

    def include_usage(self, body: ChatCompletionRequest | CompletionRequest) -> bool:
        """A stream ends with its usage: asked for, or forced (--enable-force-include-usage)."""
        return body.include_usage or self.force_include_usage

    def continuous_usage(self, body: ChatCompletionRequest | CompletionRequest) -> bool:
        """Every chunk carries the usage so far (vLLM's continuous_usage_stats, where usage is included)."""
        options = body.stream_options
        return self.include_usage(body) and options is not None and options.continuous_usage_stats

    def check_model(self, model: str | None, generates: bool = False) -> None:
        """``model`` must name the model or, for a generation request (``generates``), a LoRA adapter."""
        if model in self.lora_adapters and not generates:
            raise APIError.invalid(f"the LoRA adapter {model!r} serves generation (chat, completions, responses), "
                                   "not this endpoint", "model")
        check_model_name(model, (self.model_name, *self.aliases, *self.lora_adapters))

    def check_priority(self, priority: int) -> None:
        """A priority other than 0 needs --schedule-policy priority."""
        if priority and not self.priority_scheduling:
            raise APIError.invalid("priority scheduling is not enabled: start the server with --schedule-policy "
                                   "priority (vLLM's --scheduling-policy priority) to serve a priority other than 0",
                                   "priority")

    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names, or None (the base model)."""
        return model if model in self.lora_adapters else None

    def answering_model(self, model: str | None) -> str:
        """The model name a response shows: the adapter's, or the served model's."""
        return self.adapter(model) or self.model_name

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
            reasoning_parser=self.reasoning_parser,
            constrained=constrained,
            tool_parser=self.tool_call_parser if wants_tools and not body.forced_tool else None,
            forced_tools=body.forced_tool,
            forced_function=named_tool(body.tool_choice),  # checked by body.structure()
            single_call=not body.parallel_tool_calls,
            tool_params=tool_parameters(body.tools),
        )

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model, generates=True)
        reqs, output, params = self.chat_requests(body)
        fmt = ChatFormat(self.answering_model(body.model), self.include_usage(body),
                         logprobs=params.logprobs is not None, output=output, request_id=request_id(request),
                         echo=body.echoed_text(), tokens_as_ids=body.return_tokens_as_token_ids or self.tokens_as_ids)
        fmt.prompt_logprobs = body.prompt_logprobs
        fmt.stop_token_ids = frozenset(params.stop_token_ids or ())
        beam = body.beam_search_params(params, body.structured_param)
        return await self.run(reqs, fmt, body.stream, request, body.n, self.continuous_usage(body), beam)

    def chat_requests(
        self, body: ChatCompletionRequest
    ) -> tuple[list[TokenizeRequest], ChatOutputConfig, SamplingParams]:
        """The backend request of a chat call (its n choices in one), checked against the limits, and how
        to split their output."""
        body.check()
        check_request_template(body.chat_template, self.trust_request_chat_template)
        structure = body.structure()
        params = body.sampling_params(body.effective_max_tokens, structure, self.sampling_defaults)
        self.check_priority(params.priority)  # here too: a background response's is a 400, not a failed response
        output = self.chat_output(body, constrained=structure is not None)
        if output.tool_parser in NEEDS_SPECIAL_TOKENS:  # its calls start with a special token: the text keeps them
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        params = msgspec.structs.replace(params, lora=self.adapter(body.model))
        self.limits.check_sequences(1, body.n)
        messages = body.template_messages()
        template_kwargs = body.template_kwargs()
        self.limits.check_chat(messages, body.tools, template_kwargs, body.documents)
        first, *more = params.choices()
        req = TokenizeRequest(
            rid=self.frontend.new_rid(),
            params=first,
            messages=messages,
            chat_template_kwargs=template_kwargs,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=None if self.exclude_tools_when_tool_choice_none and body.tool_choice == "none"
            else template_tools(body.tools),
            documents=body.documents,
            structured_param=body.structured_param,
            chat_template=body.chat_template,
            more_choices=[(self.frontend.new_rid(), choice.seed) for choice in more],
        )
        return [req], output, params

    async def completion(
        self, body: CompletionRequest, request: Request, decode: Callable[[list[int]], Awaitable[str]]
    ) -> Response:
        """``decode``: a token-id prompt's text, for ``echo``."""
        self.check_model(body.model, generates=True)
        body.check()
        generates = body.max_tokens != 0  # 0 (with echo): one token is generated and left out
        params = body.sampling_params(body.max_tokens if generates else 1, body.structure(), self.sampling_defaults)
        params = msgspec.structs.replace(params, lora=self.adapter(body.model))
        reqs = []
        prompts = body.prompts()
        self.limits.check_sequences(len(prompts), body.n)
        for prompt in prompts:
            if isinstance(prompt, str):
                self.limits.check_text(len(prompt), "prompt")
            else:
                self.limits.check_ids(len(prompt), "prompt", params.truncate_prompt_tokens is not None)
        for prompt in prompts:  # choice index = prompt index * n + i, as OpenAI orders them
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            first, *more = params.choices()
            reqs.append(TokenizeRequest(rid=self.frontend.new_rid(), params=first, text=text, input_ids=ids,
                                        structured_param=body.structured_param,
                                        more_choices=[(self.frontend.new_rid(), choice.seed) for choice in more]))
        echo = None
        if body.echo:  # each choice's text starts with its prompt's
            echo = [p if isinstance(p, str) else await decode(p) for p in prompts for _ in range(body.n)]
        fmt = CompletionFormat(self.answering_model(body.model), self.include_usage(body),
                               params.logprobs is not None, echo, generates, request_id=request_id(request),
                               tokens_as_ids=body.return_tokens_as_token_ids or self.tokens_as_ids,
                               echo_top=body.logprobs or 0)
        fmt.prompt_logprobs = body.prompt_logprobs
        fmt.stop_token_ids = frozenset(params.stop_token_ids or ())
        beam = body.beam_search_params(params, body.structured_param)
        return await self.run(reqs, fmt, body.stream, request, body.n, self.continuous_usage(body), beam)

    async def run(
        self, reqs: list[TokenizeRequest], fmt: ResponseFormat, stream: bool, request: Request | None, n: int = 1,
        continuous_usage: bool = False, beam: BeamSearchParams | None = None,
    ) -> Response:
        """``request``: the HTTP client whose disconnection aborts the requests (None: no client, a
        background response). ``continuous_usage``: every stream chunk carries the usage so far. ``beam``: the
        choices are a beam search's (``server/beam_search.py``)."""
        self.check_priority(next((req.params.priority for req in reqs if req.params.priority), 0))
        if beam is None:
            gen = Generation(self.frontend, self.metrics, reqs, choices_per_prompt=n, timeout=self.request_timeout,
                             shown=fmt.shows_output)
        elif self.prompts is None:
            raise APIError.invalid("use_beam_search is not served here", "use_beam_search")
        else:
            gen = BeamGeneration(self.frontend, self.metrics, reqs, beam, self.prompts, self.request_timeout,
                                 reqs[0].params.logprobs, self.lora_adapters)
        if continuous_usage:
            fmt.usage_so_far = gen.streamed_usage
        disconnected = request.is_disconnected if request is not None else None
        try:  # from the first submit: whatever fails later, nothing this call started keeps running
            await gen.start()
            if not stream:
                while not gen.finished:
                    await gen.next(disconnected)
                return JSONResponse(fmt.response(gen.choices.values(), gen.usage()))
            # Wait for every prompt's first answer, so a rejection still gets a 4xx status.
            early: list[tuple[Choice, ApiOutput]] = []
            while not gen.all_started:
                early.append(await gen.next(disconnected))
        except ClientGone:
            await gen.abort(client_gone=True)
            return Response(status_code=499)
        except APIError:
            await gen.abort()
            lora = reqs[0].params.lora
            if lora is not None and lora not in self.lora_adapters:  # unloaded after the check: the engine refused it
                raise APIError.model_not_found(lora) from None
            raise
        except BaseException:
            await gen.abort()
            raise
        return sse(_stream(gen, fmt, early, has_client=request is not None))


def sse(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    """An SSE stream of ``chunks``."""
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream(
    gen: Generation, fmt: ResponseFormat, early: list[tuple[Choice, ApiOutput]], has_client: bool = True
) -> AsyncIterator[bytes]:
    """SSE body. If the client goes away (the task is cancelled), the rest is aborted; without a client (a background
    response) only a cancel or a delete stops it early, which is no disconnect."""
    failed = False
    try:
        for choice in sorted(gen.choices.values(), key=lambda c: c.index):
            start = fmt.start_chunk(choice.index)
            if start is not None:
                yield start
        for choice, out in early:
            choice.streamed_tokens += out.new_tokens
            for chunk in fmt.output_chunks(choice, out):
                yield chunk
        while not gen.finished and not failed:
            # The outputs that arrived while the last write went out go in one write: a server behind its streams
            # pays its per-write cost (ASGI send, HTTP framing, a syscall) once per wake-up, not once per token.
            chunks: list[bytes] = []
            try:
                event: tuple[Choice, ApiOutput] | None = await gen.next()
                while event is not None:
                    choice, out = event
                    choice.streamed_tokens += out.new_tokens
                    chunks += fmt.output_chunks(choice, out)
                    event = gen.next_ready()
            except APIError as e:
                failed = True
                chunks.append(fmt.error_chunk(e))
            if chunks:
                yield b"".join(chunks)
        for chunk in fmt.end_chunks(gen.usage(), failed):
            yield chunk
    finally:
        if not gen.finished:
            await gen.abort(client_gone=has_client and not failed)
