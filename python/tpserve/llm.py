"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``.

It drives the server's ranks and scheduler loop (``tpserve.launch.ranks``: tp_size 1 in this
process, else a process per rank, dp_size replicas routed as the server routes them), collects
rank 0's outputs and watches stop strings (aborting a request at one, as the detokenizer does).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import numbers
import os
import random
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from tqdm import tqdm

from tpserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from tpserve.config import ModelConfig
from tpserve.engine_config import KV_CACHE_DTYPE_ALIASES, EngineConfig, check_can_start
from tpserve.launch.ranks import RankDriver, start_ranks
from tpserve.message import (
    AbortRequest, BatchTokenOutput, FlushCache, GenerateRequest, GetStats, LoadLoRA, SchedulerStats, TokenOutput,
    UnloadLoRA,
)
from tpserve.llm_lora import LoRAMethods
from tpserve.llm_pooling import PoolingMethods
from tpserve.inputs import LoRARequest
from tpserve.outputs import CompletionOutput, RequestOutput, position_logprobs
from tpserve.sampling_defaults import load_sampling_defaults
from tpserve.sampling_params import SEED_LIMIT, SamplingParams
from tpserve.scheduler.gc_control import frozen_heap
from tpserve.tokenizer.prepare import truncated_prompt, with_bad_words_encoded
from tpserve.tokenizer.stream import OutputText

if TYPE_CHECKING:
    from tpserve.tokenizer.prepare import PromptPreparer

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """One request of a call, its completion filled in from the ranks' outputs."""

    request: GenerateRequest
    result: RequestOutput
    output: CompletionOutput
    prompt_index: int
    tokenizer: Any
    text: OutputText | None = None  # with stop strings: the text as it comes, cut at one; else decoded at the end
    parts: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # each generated token's rank in the vocabulary, with logprobs
    ended_by_token: bool = False  # by EOS or a stop token, whose text is left out

    def __post_init__(self) -> None:
        params = self.request.params
        if params.stop:
            self.text = OutputText(self.tokenizer, params.stop, params.include_stop_str_in_output, params.min_tokens,
                                   params.skip_special_tokens)

    def add(self, out: TokenOutput) -> bool:
        """Take one output; True once the completion is finished (at a stop string, before the ranks know it)."""
        completion, params = self.output, self.request.params
        if self.text is not None:
            self.parts.append(self.text.add(out.token_ids, out.matched_stop, final=out.finish_reason is not None))
            out = out.cut(self.text.kept)  # not the tokens after a stop string (several tokens a step: drafts)
        completion.token_ids.extend(out.token_ids)
        if out.logprobs is not None:  # in place: a new list per output made a long generation's copies quadratic
            if completion.token_logprobs is None:
                completion.token_logprobs, completion.top_logprobs = [], []
            completion.token_logprobs.extend(out.logprobs)
            completion.top_logprobs.extend(out.top_logprobs or [])
            self.ranks.extend(out.ranks or [])
        if out.prompt_logprobs is not None:
            self.result.prompt_token_logprobs = [None, *out.prompt_logprobs]
            self.result.prompt_top_logprobs = [None, *(out.prompt_top_logprobs or [])]
            self.result.prompt_ranks = [None, *(out.prompt_ranks or [])]
        if out.cached_tokens and completion.index == 0:  # with the request's first output
            self.result.num_cached_tokens = out.cached_tokens
        if out.embedding is not None:
            self.result.hidden_state = out.embedding
        finish = out.finish_reason
        if isinstance(out.matched_stop, int):
            self.ended_by_token = True
            if out.matched_stop in (params.stop_token_ids or ()):
                completion.stop_reason = out.matched_stop
        if self.text is not None:
            if self.text.stop.stopped:  # at its stop string (completed by its last token, too)
                finish, completion.stop_reason = "stop", self.text.stop.matched
        if finish is not None:
            completion.finish_reason = finish
        return finish is not None

    def finish(self, decode: Callable[[int], str | None]) -> None:
        """The text, and the log-probabilities as vLLM lays them out (``decode``: one token's text)."""
        self.finish_text()
        completion, result = self.output, self.result
        if completion.token_logprobs is not None:
            tops = completion.top_logprobs or []
            completion.logprobs = [position_logprobs(t, lp, rank, top, decode) for t, lp, rank, top in
                                   zip(completion.token_ids, completion.token_logprobs, self.ranks, tops)]
        if completion.index == 0 and result.prompt_token_logprobs is not None:
            ranks, tops = result.prompt_ranks or [], result.prompt_top_logprobs or []
            result.prompt_logprobs = [None, *(
                position_logprobs(t, lp, rank, top or [], decode) for t, lp, rank, top in
                zip(result.prompt_token_ids[1:], result.prompt_token_logprobs[1:], ranks[1:], tops[1:]))]

    def finish_text(self) -> None:
        params = self.request.params
        if self.text is not None:
            self.output.text = "".join(self.parts)
        elif self.tokenizer is not None:
            ids = self.output.token_ids
            if self.ended_by_token and not params.include_stop_str_in_output:
                ids = ids[:-1]  # the stop token's text is left out, as the server does
            self.output.text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)


class LLM(PoolingMethods, LoRAMethods):
    """Offline generation. ``LLM(model_dir, tp_size=2)`` runs two rank processes on this host;
    ``dp_size=2`` runs two independent replicas (of tp_size ranks each) and spreads the requests
    over them (``load_balance_method``: see ``tpserve.router.policy``)."""

    def __init__(
        self,
        model: str,
        tp_size: int = 1,
        device: str | None = None,
        dtype: str | None = None,
        load_format: str = "auto",
        dp_size: int = 1,
        load_balance_method: str = "cache_aware",
        seed: int | None = None,
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
        **engine_kwargs,
    ) -> None:
        """``seed``: the engine's (``load_format="dummy"`` weights are drawn with it, as with the CLI's ``--seed``),
        and where a request's SamplingParams has none, its seed comes from a generator seeded with it, so a script
        run again samples the same (None: the engine's default, and a different request seed each run).
        ``generation_config``, ``override_generation_config``: the sampling parameters of calls given none
        (``get_default_sampling_params``), as the CLI's flags (``auto``: the model's generation_config.json). Other
        keyword arguments are ``EngineConfig``'s (or vLLM's names for them)."""
        from tpserve.launch.args import resolve_model_dir
        from tpserve.router.policy import LOAD_BALANCE_METHODS

        if load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"load_balance_method must be one of {', '.join(LOAD_BALANCE_METHODS)}, got {load_balance_method!r}"
            )
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a model directory or a Hugging Face id, got {model!r}")
        if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)):
            raise TypeError(f"seed must be an integer or None, got {seed!r}")
        aliases = {_VLLM_KWARGS[name]: name for name in engine_kwargs if name in _VLLM_KWARGS}
        engine_kwargs = _engine_kwargs(engine_kwargs)
        if seed is not None:
            engine_kwargs["seed"] = int(seed)
        tp_size = engine_kwargs.pop("tp_size", tp_size)
        dp_size = engine_kwargs.pop("dp_size", dp_size)
        if isinstance(dtype, torch.dtype):  # as vLLM takes it
            dtype = str(dtype).removeprefix("torch.")
        model = resolve_model_dir(os.fspath(model))  # a local directory, or a HF id from the local cache (as the server)
        if not os.path.isfile(os.path.join(model, "config.json")):  # as the CLI says it (was a FileNotFoundError)
            raise ValueError(f"model: {model} has no config.json")
        try:
            self.config = EngineConfig(
                model=model, tp_size=tp_size, device=device, dtype=dtype, load_format=load_format, dp_size=dp_size,
                **engine_kwargs,
            )
        except ValueError as e:  # named as the caller named it: max_num_seqs, not max_running_requests
            message = str(e)
            for target, name in aliases.items():
                message = re.sub(rf"\b{target}\b", f"{name} (tpserve's {target})", message)
            if message == str(e):
                raise
            raise ValueError(message) from None
        self.model_config = self.config.load_model_config()
        check_can_start(self.config, self.model_config)  # fail here, before spawning anything
        if not isinstance(generation_config, str) or not isinstance(override_generation_config, (dict, type(None))):
            raise TypeError("generation_config must be 'auto', 'vllm' or a directory, and override_generation_config "
                            f"a dict or None; got {generation_config!r}, {override_generation_config!r}")
        self.sampling_defaults = load_sampling_defaults(model, generation_config, override_generation_config,
                                                        names=("generation_config", "override_generation_config"))
        self.tokenizer = _load_tokenizer(model)
        self._next_rid = 0
        # One call at a time talks to the ranks: each call reads the shared output stream and keeps only its own
        # requests' outputs, so a second thread's call would lose the first's (generate/chat from threads queue here).
        self._calls = threading.Lock()
        self._seed_rng = random.Random(None if seed is None else int(seed))
        self._adapters = dict(self.config.lora_modules)  # the LoRA adapters loaded: name -> directory
        # one LoRA update at a time (add_lora, remove_lora, a LoRARequest's adapter loaded on first use: _lora_name)
        self._lora_updates = threading.RLock()
        self._driver: RankDriver | None = start_ranks(self.config, load_balance_method)

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call given no SamplingParams samples with: the model's generation config's (as vLLM's)."""
        return SamplingParams(**self.sampling_defaults)

    def generate(
        self,
        prompts: str | Mapping[str, Any] | Iterable[str | Sequence[int] | Mapping[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Completions of each prompt (a string, a token-id list, or vLLM's ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``), given as any iterable of them, or one string or dict alone (as vLLM;
        a token-id list alone is ``[[...]]``), with one ``SamplingParams`` or one per prompt; results in prompt
        order. ``lora_request``: one LoRA adapter for all prompts or one per prompt (None: the base model), among
        those the LLM was started with (``lora_modules``). ``priority``: one per prompt, as vLLM's
        (``schedule_policy="priority"`` only; lower first)."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        elif isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a list of strings, token-id lists or {{'prompt': text}} / "
                            f"{{'prompt_token_ids': ids}} dicts, got {prompts!r}")
        prompts = list(prompts)  # any sequence or iterable of prompts (a generator, a 2-D numpy array), as vLLM
        if prompts and isinstance(prompts[0], numbers.Integral):
            raise TypeError("prompts must be a list of strings or a list of token-id lists, got a list of integers "
                            "(one token-id prompt is [[...]])")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        sampling_params = _params_per_prompt(sampling_params, len(prompts))
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
            sampling_params = [msgspec.structs.replace(p, priority=v) for p, v in zip(sampling_params, priority)]
        if lora_request is not None:
            adapters = [lora_request] * len(prompts) if isinstance(lora_request, LoRARequest) else list(lora_request)
            if len(adapters) != len(prompts):
                raise ValueError(f"got {len(adapters)} LoRA requests for {len(prompts)} prompts")
            sampling_params = [p if a is None else msgspec.structs.replace(p, lora=self._lora_name(a))
                               for p, a in zip(sampling_params, adapters)]
        checked: dict[int, SamplingParams] = {}  # each params object once (one is often given for every prompt)
        for i, params in enumerate(sampling_params):
            if id(params) not in checked:
                self._check_params(params)
                checked[id(params)] = with_bad_words_encoded(params, self.tokenizer)
            sampling_params[i] = checked[id(params)]
        context = self.config.max_model_len or self.model_config.context_length
        encoded = [truncated_prompt(self._encode(prompt, i), params, context)
                   for i, (prompt, params) in enumerate(zip(prompts, sampling_params))]
        with self._calls:  # request ids too: each call's are its own
            prompt_requests = []
            for input_ids, params in zip(encoded, sampling_params):
                seed = params.seed if params.seed is not None else self._seed_rng.randrange(SEED_LIMIT)
                choices = msgspec.structs.replace(params, seed=seed).choices()
                prompt_requests.append([GenerateRequest(self._next_rid + i, input_ids, p) for i, p in enumerate(choices)])
                self._next_rid += len(choices)
            texts = [_prompt_text(prompt) for prompt in prompts]
            return self._run(self._live_driver("generate"), prompt_requests, texts, use_tqdm)

    def chat(
        self,
        messages: Sequence[Any] | Sequence[Sequence[Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of OpenAI-style messages) or several (a list of such lists),
        as vLLM's ``LLM.chat``: each is rendered by the model's chat template as the HTTP chat endpoint
        renders it, then generated as ``generate`` does (``sampling_params``: one, or one per conversation).
        ``chat_template`` (Jinja text, as in the file of the server's ``--chat-template``) renders them
        instead of the model's template. The output's text is the raw completion: reasoning and tool
        calls are not split out. ``lora_request``: as ``generate``'s (one per conversation, or one for all)."""
        self._live_driver("chat")
        if not isinstance(messages, (str, Mapping)) and isinstance(messages, Iterable):
            messages = list(messages)  # a generator of messages or of conversations too
        if isinstance(messages, (str, Mapping)) or not messages:
            raise TypeError("messages must be a list of messages or a list of conversations (lists of messages)")
        if chat_template is not None:
            _check_chat_template(chat_template)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise TypeError(f"chat_template_kwargs must be a dict, got {chat_template_kwargs!r}")
        one = not isinstance(messages[0], Sequence) or isinstance(messages[0], str)
        conversations = [messages] if one else list(messages)
        if self.tokenizer is None:
            raise ValueError("chat needs the model's tokenizer; this model has none")
        from tpserve.tokenizer.prepare import PromptLimits, PromptPreparer

        limits = PromptLimits(self.model_config.context_length, self.model_config.vocab_size)
        preparer = PromptPreparer(self.tokenizer, limits, chat_template=chat_template)
        if tools:  # checked and shown to the template as the HTTP chat endpoint shows them (vLLM's tool dump)
            from tpserve.parsers.constraints import FieldError, check_tools, template_tools

            try:
                check_tools(tools)
            except FieldError as e:
                raise ValueError(e.message) from None
            tools = template_tools(tools)
        options = dict(chat_template_kwargs=chat_template_kwargs, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, tools=tools or None)
        prompts = [self._chat_ids(preparer, c, i, **options) for i, c in enumerate(conversations)]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: str | Mapping[str, Any] | Iterable[str | Sequence[int] | Mapping[str, Any]],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: each prompt's ``params.beam_width`` best beams (``tpserve.beam_search`` says
        how), each step one ``generate`` call over every live beam of every prompt. ``lora_request``: one LoRA
        adapter for all prompts or one per prompt, as ``generate``'s (each beam's steps run with its prompt's)."""
        self._live_driver("beam_search")
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            adapters = [lora_request] * len(prompts)
        elif len(adapters := list(lora_request)) != len(prompts):
            raise ValueError(f"got {len(adapters)} LoRA requests for {len(prompts)} prompts")
        context = self.config.max_model_len or self.model_config.context_length
        searches = []
        for i, prompt in enumerate(prompts):
            ids = self._encode(prompt, i)
            if not ids or len(ids) + params.max_tokens > context:
                raise ValueError(f"prompts[{i}] has {len(ids)} tokens; with max_tokens {params.max_tokens} that is "
                                 f"more than the context length, {context}")
            # vLLM's offline beams keep their EOS token (include_stop_str_in_output is the HTTP API's)
            searches.append(BeamSearch(ids, dataclasses.replace(params, include_stop_str_in_output=True),
                                       getattr(self.tokenizer, "eos_token_id", None)))
        step = params.step_params()
        with tqdm(total=params.max_tokens, desc="Beam search", unit="step", disable=not use_tqdm) as bar:
            while live := [(search, adapter) for search, adapter in zip(searches, adapters) if not search.done]:
                beams = [({"prompt_token_ids": beam.tokens}, adapter)
                         for search, adapter in live for beam in search.live]
                outputs = iter(self.generate([beam for beam, _ in beams], step, use_tqdm=False,
                                             lora_request=[adapter for _, adapter in beams]))
                for search, _ in live:
                    positions = [next(outputs).outputs[0].logprobs[0] for _ in search.live]
                    search.advance([({t: p.logprob for t, p in position.items()}, position) for position in positions])
                bar.update()
        results = []
        for search in searches:
            best = search.best()
            for beam in best:  # vLLM's text: the whole sequence's, the prompt's included
                beam.text = self.tokenizer.decode(beam.tokens) if self.tokenizer is not None else None
            results.append(BeamSearchOutput(best))
        return results

    @staticmethod
    def _chat_ids(preparer: PromptPreparer, conversation: Sequence[Any], index: int, **options: Any) -> list[int]:
        """One conversation's prompt: the HTTP chat endpoint's checks, the tokenizer worker's rendering."""
        from pydantic import TypeAdapter, ValidationError

        from tpserve.message.frontend import TokenizeRequest
        from tpserve.server.errors import APIError
        from tpserve.server.protocol import ChatMessage, check_continuation
        from tpserve.tokenizer.prepare import InvalidRequest

        if not conversation:
            raise ValueError(f"conversation {index} has no messages")
        try:
            chat = TypeAdapter(list[ChatMessage]).validate_python(list(conversation))
        except ValidationError as e:
            error = e.errors()[0]
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
            raise ValueError(f"conversation {index}: messages{where}: {error['msg']}") from None
        try:
            check_continuation(chat, options["add_generation_prompt"], options["continue_final_message"])
            messages = [m.to_template(i) for i, m in enumerate(chat)]
            req = TokenizeRequest(rid=0, params=SamplingParams(), messages=messages, **options)
            return preparer.input_ids(req)[0]
        except (APIError, InvalidRequest) as e:
            raise ValueError(f"conversation {index}: {e.message}") from None

    def _run(
        self, driver: RankDriver, prompt_requests: list[list[GenerateRequest]], texts: list[str | None],
        progress: bool,
    ) -> list[RequestOutput]:
        """Send each prompt's requests (one per completion) and collect their outputs until all finish.
        A request that cannot run raises ValueError; on any exception the ranks drop what is left of this call."""
        results = [RequestOutput(reqs[0].input_ids, [CompletionOutput(i) for i in range(len(reqs))],
                                 request_id=str(reqs[0].rid), prompt=text)
                   for reqs, text in zip(prompt_requests, texts)]
        items = [_Pending(req, result, result.outputs[i], index, self.tokenizer)
                 for index, (result, reqs) in enumerate(zip(results, prompt_requests)) for i, req in enumerate(reqs)]
        left = [len(reqs) for reqs in prompt_requests]  # unfinished completions of each prompt
        unfinished: dict[int, _Pending] = {}
        try:  # from the first send: whatever fails later, nothing this call sent keeps running
            for item in items:
                unfinished[item.request.rid] = item
                driver.send(item.request)
            bar = tqdm(total=len(prompt_requests), desc="Generating", unit="prompt", disable=not progress)
            with bar, frozen_heap():
                while unfinished:
                    for out in driver.receive().outputs:
                        item = unfinished.get(out.rid)
                        if item is None:
                            continue  # a request of an earlier call, or one stopped here
                        if out.finish_reason == "error":
                            raise ValueError(f"prompts[{item.prompt_index}]: {out.error}")
                        if item.add(out):
                            if out.finish_reason is None:
                                driver.send(AbortRequest(out.rid))  # at its stop string: the ranks stop it
                            del unfinished[out.rid]
                            left[item.prompt_index] -= 1
                            bar.update(left[item.prompt_index] == 0)
        except BaseException as e:
            if self._driver is None:  # close() from another thread: the ranks are gone
                raise RuntimeError("the LLM was closed during this call") from e
            for rid in unfinished:
                driver.send(AbortRequest(rid))
            raise
        decoded: dict[int, str | None] = {}

        def decode(token: int) -> str | None:  # a token's text, as vLLM's Logprob.decoded_token
            if token not in decoded:
                decoded[token] = None if self.tokenizer is None else self.tokenizer.decode([token]) or ""
            return decoded[token]

        for item in items:
            item.finish(decode)
        return results

    def flush_cache(self) -> bool:
        """Drop every cached prefix (of every replica); True when every KV pool is free again."""
        return all(reply.flushed for reply in self._ask(FlushCache(), "flush_cache"))

    reset_prefix_cache = flush_cache  # vLLM's name

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (None for a model without one), as vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    def stats(self) -> SchedulerStats:
        """KV pages in use, cached and free; cumulative cache hits, evictions, preemptions
        (summed over the replicas; ``replica_stats`` gives each replica's)."""
        return sum_stats(self.replica_stats())

    def replica_stats(self) -> list[SchedulerStats]:
        """``stats`` of each data-parallel replica, in replica order."""
        return sorted((reply.stats for reply in self._ask(GetStats(), "get_stats")), key=lambda s: s.replica)

    def _take_rid(self) -> int:
        self._next_rid += 1
        return self._next_rid - 1

    def _ask(self, msg: FlushCache | GetStats | LoadLoRA | UnloadLoRA, tag: str) -> list[BatchTokenOutput]:
        """Every replica's answer (each answers once)."""
        with self._calls:
            driver = self._live_driver(tag)
            driver.send(msg)
            replies: list[BatchTokenOutput] = []
            while len(replies) < self.config.dp_size:
                reply = driver.receive()
                if reply.answers == tag:
                    replies.append(reply)
            return replies

    def _live_driver(self, method: str) -> RankDriver:
        if self._driver is None:
            raise RuntimeError(f"{method}() called after close()")
        return self._driver

    def _check_params(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if params.priority and self.config.schedule_policy != "priority":
            raise ValueError(f"priority {params.priority} needs the priority schedule policy: "
                             "LLM(..., schedule_policy='priority') (vLLM's scheduling_policy)")
        if params.structured is not None:
            from tpserve.structured.grammar import check_spec

            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer; this model has none")
            check_spec(params.structured)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer; this model has none")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer; this model has none (give bad_words_token_ids)")
        for name, ids in params.token_id_fields():
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is out of range [0, {vocab})")

    def _encode(self, prompt: str | Sequence[int] | Mapping[str, Any], index: int) -> list[int]:
        if isinstance(prompt, Mapping):  # vLLM's {"prompt": text} and {"prompt_token_ids": ids}
            if set(prompt) not in ({"prompt"}, {"prompt_token_ids"}):
                raise TypeError(f"prompts[{index}]: a dict prompt is {{'prompt': text}} or {{'prompt_token_ids': ids}}, "
                                f"got the keys {sorted(map(str, prompt))}")
            text = "prompt" in prompt
            prompt = prompt["prompt"] if text else prompt["prompt_token_ids"]
            if text != isinstance(prompt, str):
                raise TypeError(f"prompts[{index}]: 'prompt' takes a string, 'prompt_token_ids' a list of token ids")
        if isinstance(prompt, bytes):
            raise TypeError(f"prompts[{index}] is bytes: decode it to a string first")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token-id lists")
            return self.tokenizer.encode(prompt)  # with the model's special tokens (e.g. BOS), as the server does
        if not isinstance(prompt, Iterable):
            raise TypeError(f"prompts[{index}] must be a string or a list of token ids, got {prompt!r}")
        ids = list(prompt)
        bad = next((t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
        if bad is not None:  # int() would quietly make 1.7 the token 1
            raise ValueError(f"prompts[{index}]: token ids must be integers, got {bad!r}")
        return [int(t) for t in ids]  # numpy integers too

    def close(self) -> None:
        """Stop the rank processes, or free this process's engine (GPU memory included)."""
        driver, self._driver = self._driver, None
        if driver is not None:
            driver.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# vLLM's names for LLM's keyword arguments (the CLI takes the same aliases), and those it accepts and ignores.
_VLLM_KWARGS = {"tensor_parallel_size": "tp_size", "data_parallel_size": "dp_size", "gpu_memory_utilization": "mem_fraction",
                "max_num_seqs": "max_running_requests", "enable_expert_parallel": "expert_parallel",
                "scheduling_policy": "schedule_policy"}
# tpserve runs no code from the checkpoint
_IGNORED_KWARGS = ("trust_remote_code",)
# vLLM's switches, as the CLI takes them (launch/vllm_flags.py): name -> (the value that acts, setting, its value)
_VLLM_SWITCHES = {"enforce_eager": (True, "cuda_graph_max_bs", 0), "enable_prefix_caching": (False, "cache", "naive")}


def _engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``LLM``'s extra keyword arguments as EngineConfig's: vLLM's names taken, ignored ones dropped."""
    out: dict[str, Any] = {}
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    for given, value in kwargs.items():
        if given in _IGNORED_KWARGS:
            continue
        name = given
        if given in _VLLM_SWITCHES:
            acting_value, name, setting_value = _VLLM_SWITCHES[given]
            if value != acting_value:  # what tpserve does anyway
                continue
            value = setting_value
        if name == "kv_cache_dtype":
            value = KV_CACHE_DTYPE_ALIASES.get(value, value)
        target = _VLLM_KWARGS.get(name, name)
        if target not in known:
            close = difflib.get_close_matches(target, known | set(_VLLM_KWARGS), n=1)
            raise TypeError(f"LLM() got an unexpected keyword argument {given!r}"
                            + (f" (did you mean {close[0]!r}?)" if close else ""))
        if target in out:
            raise TypeError(f"{given} and {target} name the same setting: give one")
        json_text = target in ("hf_overrides", "speculative_config") and isinstance(value, Mapping)
        out[target] = json.dumps(value) if json_text else value
    return out


def _prompt_text(prompt: Any) -> str | None:
    """A prompt's text as vLLM's ``RequestOutput.prompt`` gives it: None for token ids."""
    if isinstance(prompt, Mapping):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams], num_prompts: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt (one given for all, repeated)."""
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str):
        raise TypeError(
            f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
        )
    for i, params in enumerate(sampling_params):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {params!r}")
    if len(sampling_params) != num_prompts:
        raise ValueError(f"got {len(sampling_params)} sampling params for {num_prompts} prompts")
    return list(sampling_params)


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' stats added up (as if of one replica, 0); their adapter names joined."""
    if len(stats) == 1:
        return stats[0]

    def total(name: str) -> int | list[str]:
        values = [getattr(s, name) for s in stats]
        return sorted(set().union(*values)) if isinstance(values[0], list) else sum(values)

    return SchedulerStats(**{f: total(f) for f in SchedulerStats.__struct_fields__ if f != "replica"})


def _check_chat_template(chat_template: Any) -> None:
    """LLM.chat's chat_template: Jinja text that compiles as the server's --chat-template must."""
    from tpserve.tokenizer.loader import check_chat_template

    if not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be the template's text (a string), got {type(chat_template).__name__}")
    if not chat_template.strip():
        raise ValueError("chat_template is empty")
    check_chat_template(chat_template, "chat_template")


def _load_tokenizer(model_dir: str):
    """The model's tokenizer, or None where the directory has none (then prompts are token ids)."""
    from tpserve.tokenizer.loader import has_tokenizer_files, load_tokenizer, missing_tokenizer_message

    if not has_tokenizer_files(model_dir):
        logger.warning("%s: prompts must be token ids and outputs have no text", missing_tokenizer_message(model_dir))
        return None
    return load_tokenizer(model_dir)  # a damaged file is a ValueError: not a model without a tokenizer
