"""Continuous batching with a prefix cache, chunked prefill and preemption.

Every step, running requests (oldest first) get their next tokens (one decoding, a chunk
prefilling) and pages, evicting cached prefixes and then preempting the newest requests; then
waiting requests are admitted while the prefill budget and pages allow. Under the priority policy
"oldest" and "newest" rank by (priority, arrival): a lower priority value comes first, as in vLLM.
Every rank runs this on the same inputs and takes the same decisions (ordered queues, batches
sorted by request id).

With overlap (the default) step i+1 is launched before step i's samples are read: a decoding
request's next input is a placeholder the engine fills on the device, and finishing is noticed
one step late. The step in flight is drained before any preemption, so all tokens are known.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from tpserve.engine.engine import Engine, LaunchedStep, PendingSample, PreparedStep
from tpserve.engine.logit_edits import LogitEdits, allowed_mask
from tpserve.engine.sampler import SamplingBatch
from tpserve.forward import SequenceInput
from tpserve.kvcache.pool import PageAllocator
from tpserve.kvcache.radix import PrefixMatch, create_prefix_cache
from tpserve.message import SchedulerStats, TokenOutput
from tpserve.pooling import task_problem, unserved_pooling
from tpserve.sampling_params import SamplingParams
from tpserve.scheduler import prompt_logprobs
from tpserve.scheduler.lora import LoRAScheduling
from tpserve.scheduler.ngram import Drafting, NgramConfig
from tpserve.scheduler.request import Request
from tpserve.structured.grammar import GrammarCompiler, MaskFiller
from tpserve.structured.waitlist import GrammarWaitlist
from tpserve.structured.worker import MaskWorker, SampledRows, StepMasks

logger = logging.getLogger(__name__)

# Prompts whose log-probabilities are asked for prefill this many tokens a step at most, together: each
# of their tokens takes a row of logits (vocabulary-wide, float32 for the log-softmax).
PROMPT_LOGPROBS_CHUNK = 512
LPM_MAX_QUEUE = 128  # longest-prefix-match ordering costs a tree walk per waiting request


@dataclass
class _Launched:
    entries: list[tuple[Request, bool]]  # (request, whether its sample counts), in batch order
    prepared: PreparedStep | None  # host work done, not started yet
    constrained: list[tuple[int, Request]]  # (row, request) of the grammar-masked samples
    handle: LaunchedStep | None = None  # None until its sampling is enqueued
    pending: PendingSample | None = None  # forward enqueued, sampling waits for grammar masks
    masks: Future[StepMasks] | None = None  # the mask worker's job for this step
    dead_end_rows: frozenset[int] = frozenset()  # rows whose grammar allowed no token (the job's, once joined)
    # per row: (request, first prompt position, count) of its extra logits rows (prompt log-probabilities)
    prompt_rows: list[tuple[Request, int, int]] = field(default_factory=list)
    # speculative decoding: row -> (its drafts, where its draft positions' samples start among the step's samples)
    drafts: dict[int, tuple[list[int], int]] = field(default_factory=dict)
    needs_drain: bool = False  # a row's next bans depend on this step's token (a bad word of several tokens)
    no_token_rows: frozenset[int] = frozenset()  # rows whose allowed tokens were all banned (LogitEdits.empty_rows)


def _no_token_error(req: Request, grammar_dead_end: bool) -> str:
    """Why a request's next step had no token it may sample."""
    n = len(req.output_ids)
    if not grammar_dead_end:
        return (f"every token in allowed_token_ids is banned after {n} generated tokens (by min_tokens, which bans "
                "the end-of-sequence and stop_token_ids, or by bad_words)")
    kind = req.params.structured.kind
    if req.grammar.only_stops:
        return f"the {kind} constraint allows only the end after {n} generated tokens, but min_tokens is {req.params.min_tokens}"
    return (f"the {kind} constraint allows no token after {n} generated tokens (a grammar that accepts no output, "
            "or none that continues from here)")


class AdmissionError(ValueError):
    """The request can never run (e.g. longer than the context or the whole KV cache)."""


class Scheduler(LoRAScheduling, Drafting):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.config
        self.page_size = engine.page_size
        self.max_model_len = engine.max_model_len
        self.eos_ids = frozenset(engine.model_config.eos_token_ids)
        self.pooling_problem = unserved_pooling(self.config.model)  # embedding requests are refused with it
        self.allocator = PageAllocator(engine.num_pages)
        self.cache = create_prefix_cache(self.config.cache, self.page_size)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.step_count = 0
        self.admissions = 0
        self.arrivals = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.evicted_pages_total = 0
        self.preemptions_total = 0
        self.check_accounting = self.config.debug_check_invariants
        self.speculative = NgramConfig.from_json(self.config.speculative_config)
        self.overlap = not self.config.disable_overlap
        self.draft_tokens_total = 0
        self.accepted_tokens_total = 0
        self.inflight: _Launched | None = None
        self.decodes_held = False  # the last step left the decodes out (prefill work past --mixed-prefill-tokens)
        self.prompt_logprob_rows_left = PROMPT_LOGPROBS_CHUNK  # this step's (see _chunk)
        self.free_slots: list[int] = []  # penalty-state slots given back (a min-heap)
        self.num_slots = 0
        # structured-output requests wait here until their grammar is compiled and attached
        self.compiling: GrammarWaitlist[Request] = GrammarWaitlist(
            GrammarCompiler(self.config.model, engine.model_config.vocab_size, sorted(self.eos_ids)),
            self.config.grammar_compile_timeout,
        )
        filler = MaskFiller(engine.model_config.vocab_size, engine.device.type == "cuda", self.config.grammar_threads)
        self.masks = MaskWorker(filler, sorted(self.eos_ids), device=engine.device)

    # ---- requests in and out ----
    def add_request(self, rid: int, prompt_ids: list[int], params: SamplingParams, seed: int) -> None:
        if not prompt_ids:
            raise AdmissionError("the prompt is empty")
        problem = task_problem(self.engine.model_config, params.pooling, self.pooling_problem)
        if problem is not None:
            raise AdmissionError(problem)
        vocab = self.engine.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise AdmissionError(f"prompt token ids must be in [0, {vocab})")
        after = 0 if params.pooled else 1  # a generated token's place; a pooled input may fill the context
        if len(prompt_ids) + after > self.max_model_len:
            raise AdmissionError(
                f"the prompt has {len(prompt_ids)} tokens; the context limit is {self.max_model_len}"
                + ("" if params.pooled else " (prompt plus at least one generated token)")
            )
        capacity = self.allocator.total * self.page_size
        if len(prompt_ids) + after > capacity:
            raise AdmissionError(
                f"the prompt has {len(prompt_ids)} tokens; the KV cache holds {capacity} tokens in all"
            )
        room = self.max_model_len - len(prompt_ids)
        # a pooled request takes its prompt's one sample (never shown) for the vector beside it
        max_new = 1 if params.pooled else room if params.max_tokens is None else min(params.max_tokens, room)
        adapter = None if params.lora is None else self.engine.loras.loaded.get(params.lora)
        if params.lora is not None and adapter is None:
            raise AdmissionError(f"LoRA adapter {params.lora!r} is not loaded (this engine has "
                                 f"{', '.join(self.engine.loras.loaded) or 'none'})")
        if params.priority and self.config.schedule_policy != "priority":
            raise AdmissionError(f"priority {params.priority} needs the priority schedule policy "
                                 "(--schedule-policy priority)")
        req = Request(rid, list(prompt_ids), params, seed, max_new, arrival=self.arrivals, prefix_key=params.prefix_key)
        if adapter is not None:
            req.adapter, req.prefix_key = adapter, f"{params.prefix_key}\x00{adapter.load_id}"
        self.arrivals += 1
        if params.structured is not None:
            self.compiling.add(rid, req, params.structured)
        else:
            self.waiting.append(req)

    # ---- grammars (tpserve.structured.waitlist says how the ranks agree) ----
    def grammars_ready(self) -> list[tuple[int, bool]]:
        return self.compiling.ready()

    def attach_grammar(self, rid: int, timed_out: bool = False) -> list[TokenOutput]:
        """Queue a compiling request with its matcher; a failed or timed-out compile ends it with an error."""
        taken = self.compiling.take(rid, timed_out)
        if taken is None:  # aborted meanwhile
            return []
        req, grammar, error = taken
        if error is not None:
            return [TokenOutput(rid, [], "error", prompt_tokens=len(req.prompt_ids), error=error)]
        grammar.min_tokens, grammar.early_stops = req.params.min_tokens, req.params.stops_before_min_tokens(self.eos_ids)
        req.grammar = grammar
        self.waiting.append(req)
        return []

    def abort(self, rid: int) -> bool:
        if self.compiling.abort(rid):
            return True
        if rid in self.running:
            self._retire(self.running.pop(rid))
            return True
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._free_slot(req)
                return True
        return False

    def close(self) -> None:
        """Stop the grammar threads (a mask job is never left running between steps)."""
        self.masks.close()
        self.compiling.close()

    def flush_cache(self) -> bool:
        """Drop every cached prefix no request uses; True when the whole pool is free again."""
        self.allocator.free(self.cache.evict(self.cache.num_pages))
        return self.allocator.num_free == self.allocator.total

    @property
    def has_work(self) -> bool:
        """Something to step (requests compiling their grammar wait for ``attach_grammar``)."""
        return bool(self.waiting or self.running or self.inflight)

    def stats(self) -> SchedulerStats:
        free, cached = self.allocator.num_free, self.cache.num_evictable
        return SchedulerStats(
            running=len(self.running),
            waiting=len(self.waiting) + len(self.compiling),  # a request compiling its grammar waits too (vLLM's)
            kv_pages_used=self.allocator.total - free - cached,
            kv_pages_total=self.allocator.total,
            kv_pages_cached=cached,
            prompt_tokens_total=self.prompt_tokens_total,
            cached_tokens_total=self.cached_tokens_total,
            evicted_pages_total=self.evicted_pages_total,
            preemptions_total=self.preemptions_total,
            replica=self.engine.config.dp_rank,
            draft_tokens_total=self.draft_tokens_total,
            accepted_tokens_total=self.accepted_tokens_total,
            **self._lora_stats(),
        )

    # ---- one step ----
    def step(self) -> list[TokenOutput]:
        """Schedule and prepare one step, enqueue the previous step's sampling deferred for grammar
        masks, start this one, then apply the samples of the previous step (overlap) or this one.

        A constrained step's sampling waits for its masks, and those for the previous step's
        tokens; so this step's host work comes first, while the device runs that step's forward."""
        self.step_count += 1
        self.cache.clock = self.step_count
        self._release_lora_slots()
        outputs: list[TokenOutput] = []
        scheduled = self._schedule(outputs)
        launched = self._prepare(scheduled) if scheduled else None
        if self.inflight is not None and self.inflight.pending is not None:
            self._sample_constrained(self.inflight)
        if launched is not None:
            self._start(launched)
        if self.inflight is not None:  # the device ran it while this step was being planned
            outputs += self._process(self.inflight)
        self.inflight = launched
        if self.inflight is not None and (not self.overlap or self.inflight.needs_drain):
            outputs += self._drain()
        if self.check_accounting:
            self._check_accounting()
        return outputs

    def _schedule(self, outputs: list[TokenOutput]) -> list[tuple[Request, int]]:
        budget = self.config.chunked_prefill_size if self.config.chunked_prefill_size > 0 else 1 << 62
        self.prompt_logprob_rows_left = PROMPT_LOGPROBS_CHUNK
        preemptions = self.preemptions_total
        decodes: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []
        for req in sorted(self.running.values(), key=self._rank):
            if self.running.get(req.rid) is not req or req.samples_left <= 0:
                continue  # gone during a drain, or only waiting for its last sample
            todo = req.num_to_compute
            req.drafts = self._drafts(req) if todo == 1 else []
            n = 1 + len(req.drafts) if todo == 1 else self._chunk(req, min(todo, budget))
            if n > 0 and self._grow(req, req.num_cached + n, outputs):
                if todo == 1:
                    decodes.append((req, n))
                else:
                    prefills.append((req, n))
                    budget -= n
        # A drain inside _grow may have finished requests scheduled before it.
        decodes = [(req, n) for req, n in decodes if self.running.get(req.rid) is req]
        prefills = [(req, n) for req, n in prefills if self.running.get(req.rid) is req]
        prefills += self._admit(budget, outputs)
        held, self.decodes_held = self.decodes_held, False
        if (
            decodes
            and sum(n for _, n in prefills) > self.config.mixed_prefill_tokens
            and self.preemptions_total == preemptions
        ):
            # Prefills alone hold each decode back one step, not one long step per chunk; then the decodes run
            # alone (a prompt of many chunks would otherwise hold them for all of its chunks). Not when pages
            # ran short: only finishing decodes free them, and a preempted prompt re-admitted every step would
            # otherwise keep them from ever running.
            if held:
                return decodes
            self.decodes_held = True
            return prefills
        return decodes + prefills

    def _prepare(self, scheduled: list[tuple[Request, int]]) -> _Launched:
        scheduled.sort(key=lambda item: item[0].rid)
        params = [req.params for req, _ in scheduled]
        if any(p.edits_logits for p in params):  # edits and grammar masks are a row per sequence: no drafts beside them
            scheduled = [(req, n - len(req.drafts)) for req, n in scheduled]
            for req, _ in scheduled:
                req.drafts = []
        steps = [len(req.output_ids) + req.pending + len(req.drafts) for req, _ in scheduled]
        # Only a chunk that reaches the end of the known sequence yields a usable sample (a pooled request's
        # vector too: the sequence is pooled there); a chunk of drafts yields one at each.
        sampled = [bool(req.drafts) or req.num_cached + n == req.num_tokens + req.pending for req, n in scheduled]
        seqs = [SequenceInput(req.input_ids(n - len(req.drafts)) + req.drafts, req.num_cached, req.pages,
                              extra_logits=len(req.drafts), pooled=last and req.params.pooling is not None,
                              lora=req.lora_slot)
                for (req, n), last in zip(scheduled, sampled)]
        drafted = [(row, req) for row, (req, _) in enumerate(scheduled) if req.drafts]
        seeds = [req.seed for req, _ in scheduled]
        for _, req in drafted:  # the draft positions' samples, after the sequences': each at its own step
            params += [req.params] * len(req.drafts)
            seeds += [req.seed] * len(req.drafts)
            first = len(req.output_ids) + req.pending
            steps += range(first, first + len(req.drafts))
        vocab = self.engine.model_config.vocab_size
        sampling = SamplingBatch.build(params, seeds, steps, vocab, self.engine.device)
        params = params[: len(scheduled)]
        if any(p.edits_logits for p in params):
            sampling.edits = self._logit_edits(scheduled, params, steps, sampled)
        no_token_rows = sampling.edits.empty_rows if sampling.edits is not None else frozenset()
        wanted = [req.params.logprobs for req, _ in scheduled if req.params.logprobs is not None]
        counts, targets, prompt_top = prompt_logprobs.plan_rows(scheduled, seqs)
        prompt_rows = [(req, req.num_cached, count) for (req, _), count in zip(scheduled, counts) if count]
        draft_rows, drafts, extra, sample_row = [], {}, 0, len(scheduled)
        for row, seq in enumerate(seqs):  # the extra logits rows, in sequence order: prompt targets' or drafts'
            req = scheduled[row][0]
            if req.drafts:
                draft_rows += range(extra, extra + len(req.drafts))
                drafts[row] = (req.drafts, sample_row)
                sample_row += len(req.drafts)
            extra += seq.extra_logits
        prepared = self.engine.prepare(seqs, sampling, max(wanted) if wanted else None, targets, prompt_top,
                                       draft_rows)
        constrained = [(row, req) for row, (req, _) in enumerate(scheduled) if sampled[row] and req.grammar is not None]
        entries = []
        for row, (req, n) in enumerate(scheduled):
            req.num_cached += n
            if sampled[row]:
                req.pending += 1
                req.future_row = row
            entries.append((req, sampled[row]))
        return _Launched(entries, prepared, constrained, prompt_rows=prompt_rows,
                         needs_drain=bool(drafts) or any(p.needs_output_history and s for p, s in zip(params, sampled)),
                         no_token_rows=no_token_rows, drafts=drafts)

    def _start(self, launched: _Launched) -> None:
        """Enqueue a prepared step; a constrained one's masks are filled on the worker while its
        forward runs, its sampling deferred."""
        prepared, launched.prepared = launched.prepared, None
        if not launched.constrained:
            launched.handle = self.engine.sample(self.engine.start(prepared))
            return
        fills = [(row, req.grammar) for row, req in launched.constrained]
        launched.masks = self.masks.submit(fills, len(launched.entries))
        launched.pending = self.engine.start(prepared)

    def _sample_constrained(self, launched: _Launched) -> None:
        """Wait for a deferred step's grammar masks, then sample. Their host buffer is refilled two
        constrained steps later, by when this step's tokens (copied after the upload) were awaited."""
        step_masks = launched.masks.result()
        launched.dead_end_rows = frozenset(step_masks.dead_rows)
        launched.handle = self.engine.sample(launched.pending, step_masks.masks)
        rows = [(row, req.rid, req.grammar) for row, req in launched.constrained]
        self.masks.sampled(SampledRows(launched.handle.result, rows))
        launched.pending = launched.masks = None

    def _logit_edits(
        self, scheduled: list[tuple[Request, int]], params: list[SamplingParams], steps: list[int], sampled: list[bool]
    ) -> LogitEdits | None:
        new_slots = []
        for req, _ in scheduled:
            if req.params.has_penalties and req.slot < 0:
                req.slot = self._take_slot()
                new_slots.append((req.slot, req.prompt_ids))
        slots = [req.slot for req, _ in scheduled]
        vocab, device = self.engine.model_config.vocab_size, self.engine.device
        for req, _ in scheduled:
            if req.params.allowed_token_ids is not None and req.allowed_mask is None:
                req.allowed_mask = allowed_mask(req.params.allowed_token_ids, vocab, device)
        outputs = [req.output_ids for req, _ in scheduled]  # complete: a step with bad words of several tokens drains
        return LogitEdits.build(params, slots, steps, sampled, new_slots, sorted(self.eos_ids), vocab, device, outputs,
                                [req.allowed_mask for req, _ in scheduled])

    def _take_slot(self) -> int:
        if self.free_slots:
            return heapq.heappop(self.free_slots)
        self.num_slots += 1
        return self.num_slots - 1

    def _free_slot(self, req: Request) -> None:
        if req.slot >= 0:
            heapq.heappush(self.free_slots, req.slot)
            req.slot = -1

    def _retire(self, req: Request) -> None:
        """A running request leaves for good (finished or aborted)."""
        self._release(req)
        self._free_slot(req)

    def _process(self, launched: _Launched) -> list[TokenOutput]:
        if launched.pending is not None:
            self._sample_constrained(launched)
        tokens = launched.handle.result()
        logprobs = launched.handle.logprobs()
        ranks = launched.handle.ranks() if logprobs is not None else None
        if launched.prompt_rows:
            prompt_logprobs.record(launched.prompt_rows, launched.handle)
        pooled = iter(launched.handle.pooled())  # in batch order, one for each pooled request's last chunk
        outputs = []
        for row, ((req, sampled), token) in enumerate(zip(launched.entries, tokens)):
            embedding = next(pooled) if sampled and req.params.pooling is not None else None
            if not sampled or self.running.get(req.rid) is not req:
                continue  # a mid-prompt chunk, or the request finished/aborted meanwhile
            req.pending -= 1
            first = not req.output_ids
            if embedding is not None:
                req.finish_reason = "stop"
                outputs.append(TokenOutput(req.rid, [], "stop", prompt_tokens=len(req.prompt_ids),
                                           cached_tokens=req.cached_tokens, embedding=embedding))
                self._retire(self.running.pop(req.rid))
                continue
            if row in launched.dead_end_rows or row in launched.no_token_rows:
                error = _no_token_error(req, grammar_dead_end=row in launched.dead_end_rows)
                outputs.append(TokenOutput(req.rid, [], "error", prompt_tokens=len(req.prompt_ids) if first else 0,
                                           error=error))
                # under overlap the next step already counts this sample's position: it holds no token to cache
                req.num_cached = min(req.num_cached, req.num_tokens)
                self._retire(self.running.pop(req.rid))
                continue
            new_tokens, rows = [token], [row]
            if row in launched.drafts:
                new_tokens, rows = self._accepted(req, *launched.drafts[row], tokens, row)
            for count, token in enumerate(new_tokens, start=1):
                req.output_ids.append(token)
                req.finish_reason = self._finish_reason(req, token)
                if req.finish_reason is not None:
                    new_tokens = new_tokens[:count]
                    break
            if row in launched.drafts:  # drafts past a finish hold no token of it
                req.num_cached = min(req.num_cached, req.num_tokens)
            out = TokenOutput(
                rid=req.rid,
                token_ids=new_tokens,
                finish_reason=req.finish_reason,
                prompt_tokens=len(req.prompt_ids) if first else 0,
                cached_tokens=req.cached_tokens if first else 0,
                matched_stop=token if req.finish_reason == "stop" else None,
            )
            if logprobs is not None and req.params.logprobs is not None:
                chosen, top_ids, top_values = logprobs
                n = req.params.logprobs
                rows = rows[: len(new_tokens)]
                out.logprobs = [chosen[r] for r in rows]
                out.top_logprobs = [list(zip(top_ids[r][:n], top_values[r][:n])) for r in rows]
                out.ranks = [ranks[r] for r in rows]
            if first and req.params.prompt_logprobs is not None:
                prompt_logprobs.attach(out, req)
            outputs.append(out)
            if req.finished:
                self._retire(self.running.pop(req.rid))
        return outputs

    def _drain(self) -> list[TokenOutput]:
        """Wait for the step in flight and apply its samples."""
        launched, self.inflight = self.inflight, None
        return self._process(launched) if launched is not None else []

    # ---- admission ----
    def _admit(self, budget: int, outputs: list[TokenOutput]) -> list[tuple[Request, int]]:
        admitted: list[tuple[Request, int]] = []
        skipped: set[int] = set()  # waiting for a LoRA slot: the requests behind them go on (vLLM's)
        while len(self.waiting) > len(skipped) and budget > 0 and len(self.running) < self.config.max_running_requests:
            req, match = self._next_waiting(skipped)
            lora_slot = 0
            if req.adapter is not None:
                lora_slot = self.engine.loras.slot_for(req.adapter, self._busy_lora_slots())
                if lora_slot is None:  # every slot holds another adapter admitted requests use
                    skipped.add(req.rid)
                    continue
            ids = req.all_ids
            cached = match.num_pages * self.page_size
            n = self._chunk(req, min(len(ids) - cached, budget))
            if n == 0:
                break  # its prompt's log-probabilities wait for the next step; requests behind it do not overtake it
            need = -(-(cached + n) // self.page_size) - match.num_pages
            # A preempted request comes back once its whole sequence fits: from its first chunk alone, the running
            # requests' growth would preempt it again before its prompt is done, over and over.
            fits = need if req.cached_tokens < 0 else -(-len(ids) // self.page_size) - match.num_pages
            self.cache.lock(match.node)
            if fits > self.allocator.num_free + self.cache.num_evictable:
                self.cache.unlock(match.node)
                if not self.running and self.inflight is None:  # it can never fit
                    self.waiting.remove(req)
                    self._free_slot(req)
                    logger.warning("request %d stopped: it no longer fits in the whole KV cache", req.rid)
                    outputs.append(TokenOutput(req.rid, [], "length"))
                    continue
                break  # it waits for pages; requests behind it do not overtake it
            self.waiting.remove(req)
            req.drafts = []
            if req.adapter is not None:
                self.engine.place_lora(lora_slot, req.adapter)
            req.lora_slot = lora_slot
            req.pages, req.num_shared_pages, req.prefix_node = list(match.pages), match.num_pages, match.node
            req.num_cached = cached
            self._allocate(req, need)
            if req.cached_tokens < 0:  # first admission (not a re-admission after preemption)
                req.cached_tokens = cached
                self.prompt_tokens_total += len(req.prompt_ids)
                self.cached_tokens_total += cached
            req.admit_order = self.admissions
            self.admissions += 1
            self.running[req.rid] = req
            admitted.append((req, n))
            budget -= n
        return admitted

    def _chunk(self, req: Request, n: int) -> int:
        """``n`` tokens, fewer for a prompt whose log-probabilities are asked (``PROMPT_LOGPROBS_CHUNK``)."""
        if not req.wants_prompt_logprobs:
            return n
        n = min(n, self.prompt_logprob_rows_left)
        self.prompt_logprob_rows_left -= n
        return n

    def _next_waiting(self, skipped: set[int]) -> tuple[Request, PrefixMatch]:
        """The request to admit next (of those not ``skipped``) and its cached prefix (whole pages, leaving a token
        to compute)."""
        waiting = [req for req in self.waiting if req.rid not in skipped] if skipped else self.waiting
        if self.config.schedule_policy == "priority":
            first = min(waiting, key=lambda r: (r.params.priority, r.arrival))
            return first, self._cached_prefix(first)
        if self.config.schedule_policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
            return waiting[0], self._cached_prefix(waiting[0])
        # lpm: the longest cached prefix first; ties keep queue order (max returns the first).
        matches = [(req, self._cached_prefix(req)) for req in waiting]
        return max(matches, key=lambda item: item[1].num_pages)

    def _cached_prefix(self, req: Request) -> PrefixMatch:
        if req.wants_prompt_logprobs:  # every prompt position's logits are needed
            return PrefixMatch([], None)
        return self.cache.match(req.all_ids[: req.num_tokens - 1], req.prefix_key)

    def _rank(self, req: Request) -> tuple[int, int]:
        """Running requests in the order they get their tokens and pages (the last is preempted first): by admission;
        under the priority policy by priority, then arrival (vLLM's), which a re-admission does not change."""
        if self.config.schedule_policy == "priority":
            return req.params.priority, req.arrival
        return 0, req.admit_order

    # ---- pages ----
    def _grow(self, req: Request, num_tokens: int, outputs: list[TokenOutput]) -> bool:
        """Give ``req`` pages for ``num_tokens`` tokens, evicting cache and preempting newer requests (by
        ``_rank``) as needed. False if ``req`` itself had to give way."""
        need = -(-num_tokens // self.page_size) - len(req.pages)
        while need > self.allocator.num_free + self.cache.num_evictable:
            if self.inflight is not None:
                # Preempted requests are recomputed from their tokens: learn the pending ones first
                # (finishing requests may also free enough pages).
                outputs += self._drain()
                if self.running.get(req.rid) is not req:
                    return False
                continue
            newer = [r for r in self.running.values() if self._rank(r) > self._rank(req)]
            if newer:
                self._preempt(max(newer, key=self._rank))
            elif len(self.running) > 1:
                self._preempt(req)
                return False
            else:  # alone and still too big: the KV cache is its length limit
                logger.warning("request %d stopped: it fills the whole KV cache", req.rid)
                req.finish_reason = "length"
                outputs.append(TokenOutput(req.rid, [], "length"))
                self._retire(self.running.pop(req.rid))
                return False
        if need > 0:
            self._allocate(req, need)
        return True

    def _allocate(self, req: Request, need: int) -> None:
        if need > self.allocator.num_free:
            freed = self.cache.evict(need - self.allocator.num_free)
            self.evicted_pages_total += len(freed)
            self.allocator.free(freed)
        req.pages.extend(self.allocator.allocate(need))

    def _preempt(self, req: Request) -> None:
        """Give back a running request's pages (its computed prefix to the cache) and queue it first
        for recompute; its sampled tokens are kept, so its output is unchanged."""
        self.preemptions_total += 1
        logger.info("preempting request %d (%d tokens) to free KV pages", req.rid, req.num_tokens)
        self._release(self.running.pop(req.rid))
        req.num_cached, req.pending = 0, 0
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        full = req.num_cached // self.page_size
        duplicates = self.cache.insert(req.all_ids[: full * self.page_size], req.pages[:full], req.prefix_key)
        self.allocator.free(duplicates + req.pages[full:])
        self.cache.unlock(req.prefix_node)
        req.pages, req.num_shared_pages, req.prefix_node = [], 0, None

    def _finish_reason(self, req: Request, token: int) -> str | None:
        params = req.params
        if not params.ignore_eos and token in self.eos_ids:
            return "stop"
        if params.stop_token_ids and token in params.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None

    def _check_accounting(self) -> None:
        own = sum(len(r.pages) - r.num_shared_pages for r in self.running.values())
        total = self.allocator.num_free + self.cache.num_pages + own
        if total != self.allocator.total:
            raise RuntimeError(
                f"KV page accounting broken: free {self.allocator.num_free} + cached {self.cache.num_pages} "
                f"+ request-owned {own} != total {self.allocator.total}"
            )
        holders = self.engine.loras.holders
        moved = [req.rid for req in self.running.values() if holders.get(req.lora_slot) is not req.adapter]
        if moved:
            raise RuntimeError(f"LoRA slot accounting broken: running requests {moved} lost their adapter's slot")
