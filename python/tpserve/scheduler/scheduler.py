"""Continuous batching with a prefix cache, chunked prefill and preemption.

Every step: running requests, oldest first, each get their next tokens (one when decoding, a
chunk when prefilling) and the pages those need, evicting cached prefixes and, if that is not
enough, preempting the newest requests; then waiting requests are admitted while the prefill
budget and pages allow. A step with more prefill tokens than ``mixed_prefill_tokens`` runs the
prefills without the decodes (prefill first): a decode then waits one step, not one long step
per chunk. Every rank runs this same code on the same inputs, so all ranks take
the same decisions: queues are ordered, batches sorted by request id, recency is a step count.

With overlap (the default) step i+1 is planned and launched before step i's samples are read:
a decoding request's next input is then a placeholder for its pending sample, which the engine
fills in on the device, and finishing (EOS, stop tokens) is noticed one step late. Before any
preemption the step in flight is drained, so a preempted request's tokens are all known.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from tpserve.forward import SequenceInput
from tpserve.engine.engine import Engine, LaunchedStep
from tpserve.engine.sampler import SamplingBatch
from tpserve.kvcache.pool import PageAllocator
from tpserve.kvcache.radix import PrefixMatch, create_prefix_cache
from tpserve.message import SchedulerStats, TokenOutput
from tpserve.sampling_params import SamplingParams
from tpserve.scheduler.request import Request

logger = logging.getLogger(__name__)

LPM_MAX_QUEUE = 128  # longest-prefix-match ordering costs a tree walk per waiting request


@dataclass
class _Launched:
    entries: list[tuple[Request, bool]]  # (request, whether its sample counts), in batch order
    handle: LaunchedStep


class AdmissionError(ValueError):
    """The request can never run (e.g. longer than the context or the whole KV cache)."""


class Scheduler:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.config
        self.page_size = engine.page_size
        self.max_model_len = engine.max_model_len
        self.eos_ids = frozenset(engine.model_config.eos_token_ids)
        self.allocator = PageAllocator(engine.num_pages)
        self.cache = create_prefix_cache(self.config.cache, self.page_size)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.step_count = 0
        self.admissions = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.evicted_pages_total = 0
        self.preemptions_total = 0
        self.check_accounting = self.config.debug_check_ranks
        self.overlap = not self.config.disable_overlap
        self.inflight: _Launched | None = None

    # ---- requests in and out ----
    def add_request(self, rid: int, prompt_ids: list[int], params: SamplingParams, seed: int) -> None:
        if not prompt_ids:
            raise AdmissionError("the prompt is empty")
        vocab = self.engine.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise AdmissionError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise AdmissionError(
                f"the prompt has {len(prompt_ids)} tokens; the context limit is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        capacity = self.allocator.total * self.page_size
        if len(prompt_ids) + 1 > capacity:
            raise AdmissionError(
                f"the prompt has {len(prompt_ids)} tokens; the KV cache holds {capacity} tokens in all"
            )
        room = self.max_model_len - len(prompt_ids)
        max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        self.waiting.append(Request(rid, list(prompt_ids), params, seed, max_new))

    def abort(self, rid: int) -> bool:
        if rid in self.running:
            self._release(self.running.pop(rid))
            return True
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return True
        return False

    def flush_cache(self) -> bool:
        """Drop every cached prefix no request uses; True when the whole pool is free again."""
        self.allocator.free(self.cache.evict(self.cache.num_pages))
        return self.allocator.num_free == self.allocator.total

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.inflight)

    def stats(self) -> SchedulerStats:
        free, cached = self.allocator.num_free, self.cache.num_evictable
        return SchedulerStats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_pages_used=self.allocator.total - free - cached,
            kv_pages_total=self.allocator.total,
            kv_pages_cached=cached,
            prompt_tokens_total=self.prompt_tokens_total,
            cached_tokens_total=self.cached_tokens_total,
            evicted_pages_total=self.evicted_pages_total,
            preemptions_total=self.preemptions_total,
        )

    # ---- one step ----
    def step(self) -> list[TokenOutput]:
        """Schedule and launch one step, then apply the samples of the step before it (overlap)
        or of this one (no overlap). Returns the requests' new tokens."""
        self.step_count += 1
        self.cache.clock = self.step_count
        outputs: list[TokenOutput] = []
        scheduled = self._schedule(outputs)
        launched = self._launch(scheduled) if scheduled else None
        if self.inflight is not None:  # the device ran it while this step was being planned
            outputs += self._process(self.inflight)
        self.inflight = launched
        if self.inflight is not None and not self.overlap:
            outputs += self._drain()
        if self.check_accounting:
            self._check_accounting()
        return outputs

    def _schedule(self, outputs: list[TokenOutput]) -> list[tuple[Request, int]]:
        budget = self.config.chunked_prefill_size if self.config.chunked_prefill_size > 0 else 1 << 62
        preemptions = self.preemptions_total
        decodes: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []
        for req in sorted(self.running.values(), key=lambda r: r.admit_order):
            if self.running.get(req.rid) is not req or req.samples_left <= 0:
                continue  # gone during a drain, or only waiting for its last sample
            todo = req.num_to_compute
            n = 1 if todo == 1 else min(todo, budget)
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
        if (
            decodes
            and sum(n for _, n in prefills) > self.config.mixed_prefill_tokens
            and self.preemptions_total == preemptions
        ):
            # A step's time grows with its prefill tokens, and every decode in it waits that long
            # for its token; alone, the prefills hold each decode back by one step only. Not when
            # pages ran short: only finishing decodes free them, and a preempted prompt re-admitted
            # every step would otherwise keep them from ever running.
            return prefills
        return decodes + prefills

    def _launch(self, scheduled: list[tuple[Request, int]]) -> _Launched:
        scheduled.sort(key=lambda item: item[0].rid)
        seqs = [SequenceInput(req.input_ids(n), req.num_cached, req.pages) for req, n in scheduled]
        sampling = SamplingBatch.build(
            [req.params for req, _ in scheduled],
            [req.seed for req, _ in scheduled],
            [len(req.output_ids) + req.pending for req, _ in scheduled],
            self.engine.model_config.vocab_size,
            self.engine.device,
        )
        wanted = [req.params.logprobs for req, _ in scheduled if req.params.logprobs is not None]
        handle = self.engine.launch(seqs, sampling, max(wanted) if wanted else None)
        entries = []
        for row, (req, n) in enumerate(scheduled):
            # Only a chunk that reaches the end of the known sequence yields a usable sample.
            sampled = req.num_cached + n == req.num_tokens + req.pending
            req.num_cached += n
            if sampled:
                req.pending += 1
                req.future_row = row
            entries.append((req, sampled))
        return _Launched(entries, handle)

    def _process(self, launched: _Launched) -> list[TokenOutput]:
        tokens = launched.handle.result()
        logprobs = launched.handle.logprobs()
        outputs = []
        for row, ((req, sampled), token) in enumerate(zip(launched.entries, tokens)):
            if not sampled or self.running.get(req.rid) is not req:
                continue  # a mid-prompt chunk, or the request finished/aborted meanwhile
            req.pending -= 1
            first = not req.output_ids
            req.output_ids.append(token)
            req.finish_reason = self._finish_reason(req, token)
            out = TokenOutput(
                rid=req.rid,
                token_ids=[token],
                finish_reason=req.finish_reason,
                prompt_tokens=len(req.prompt_ids) if first else 0,
                cached_tokens=req.cached_tokens if first else 0,
            )
            if logprobs is not None and req.params.logprobs is not None:
                chosen, top_ids, top_values = logprobs
                n = req.params.logprobs
                out.logprobs = [chosen[row]]
                out.top_logprobs = [list(zip(top_ids[row][:n], top_values[row][:n]))]
            outputs.append(out)
            if req.finished:
                self._release(self.running.pop(req.rid))
        return outputs

    def _drain(self) -> list[TokenOutput]:
        """Wait for the step in flight and apply its samples."""
        launched, self.inflight = self.inflight, None
        return self._process(launched) if launched is not None else []

    # ---- admission ----
    def _admit(self, budget: int, outputs: list[TokenOutput]) -> list[tuple[Request, int]]:
        admitted: list[tuple[Request, int]] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req, match = self._next_waiting()
            ids = req.all_ids
            cached = match.num_pages * self.page_size
            n = min(len(ids) - cached, budget)
            need = -(-(cached + n) // self.page_size) - match.num_pages
            self.cache.lock(match.node)
            if need > self.allocator.num_free + self.cache.num_evictable:
                self.cache.unlock(match.node)
                if not self.running and self.inflight is None:  # it can never fit
                    self.waiting.remove(req)
                    logger.warning("request %d stopped: it no longer fits in the whole KV cache", req.rid)
                    outputs.append(TokenOutput(req.rid, [], "length"))
                    continue
                break  # it waits for pages; requests behind it do not overtake it
            self.waiting.remove(req)
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

    def _next_waiting(self) -> tuple[Request, PrefixMatch]:
        """The request to admit next and its cached prefix (whole pages, leaving at least one
        token to compute)."""
        if self.config.schedule_policy == "fcfs" or len(self.waiting) > LPM_MAX_QUEUE:
            return self.waiting[0], self._cached_prefix(self.waiting[0])
        # lpm: the longest cached prefix first; ties keep queue order (max returns the first).
        matches = [(req, self._cached_prefix(req)) for req in self.waiting]
        return max(matches, key=lambda item: item[1].num_pages)

    def _cached_prefix(self, req: Request) -> PrefixMatch:
        return self.cache.match(req.all_ids[: req.num_tokens - 1])

    # ---- pages ----
    def _grow(self, req: Request, num_tokens: int, outputs: list[TokenOutput]) -> bool:
        """Give ``req`` pages for ``num_tokens`` tokens, evicting cache and preempting newer
        requests as needed. False if ``req`` itself had to give way."""
        need = -(-num_tokens // self.page_size) - len(req.pages)
        while need > self.allocator.num_free + self.cache.num_evictable:
            if self.inflight is not None:
                # Preempted requests are recomputed from their tokens: learn the pending ones
                # first (finishing requests may also free enough pages).
                outputs += self._drain()
                if self.running.get(req.rid) is not req:
                    return False
                continue
            newer = [r for r in self.running.values() if r.admit_order > req.admit_order]
            if newer:
                self._preempt(max(newer, key=lambda r: r.admit_order))
            elif len(self.running) > 1:
                self._preempt(req)
                return False
            else:  # alone and still too big: the KV cache is its length limit
                logger.warning("request %d stopped: it fills the whole KV cache", req.rid)
                req.finish_reason = "length"
                outputs.append(TokenOutput(req.rid, [], "length"))
                self._release(self.running.pop(req.rid))
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
        """Give back a running request's pages (its computed prefix goes to the cache) and
        queue it first for recompute; its sampled tokens are kept, so its output is unchanged."""
        self.preemptions_total += 1
        logger.info("preempting request %d (%d tokens) to free KV pages", req.rid, req.num_tokens)
        self._release(self.running.pop(req.rid))
        req.num_cached, req.pending = 0, 0
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        full = req.num_cached // self.page_size
        duplicates = self.cache.insert(req.all_ids[: full * self.page_size], req.pages[:full])
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
