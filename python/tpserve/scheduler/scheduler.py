"""Continuous batching: every step decodes the running requests and admits waiting ones.

Every rank runs this same code on the same inputs, so all ranks take the same decisions: the
waiting queue is FCFS, batches are ordered by request id, and nothing depends on timing.
"""

from __future__ import annotations

import logging
from collections import deque

from tpserve.engine.batch import SequenceInput
from tpserve.engine.engine import Engine
from tpserve.engine.sampler import SamplingBatch
from tpserve.kvcache.pool import PageAllocator
from tpserve.message import SchedulerStats, TokenOutput
from tpserve.sampling_params import SamplingParams
from tpserve.scheduler.request import Request

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The request can never run (e.g. longer than the context or the whole KV cache)."""


class Scheduler:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.config
        self.page_size = engine.page_size
        self.max_model_len = engine.max_model_len
        self.eos_ids = frozenset(engine.model_config.eos_token_ids)
        self.allocator = PageAllocator(engine.num_pages)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}

    # ---- requests in and out ----
    def add_request(self, rid: int, prompt_ids: list[int], params: SamplingParams, seed: int) -> None:
        if not prompt_ids:
            raise RequestRejected("the prompt is empty")
        vocab = self.engine.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {len(prompt_ids)} tokens; the context limit is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        room = self.max_model_len - len(prompt_ids)
        max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Request(rid, list(prompt_ids), params, seed, max_new)
        if self._pages_needed(req) > self.allocator.total:
            raise RequestRejected(
                f"the request needs {len(prompt_ids) + max_new} tokens of KV cache; the cache holds "
                f"{self.allocator.total * self.page_size}"
            )
        self.waiting.append(req)

    def abort(self, rid: int) -> bool:
        if rid in self.running:
            self._release(self.running.pop(rid))
            return True
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_pages_used=self.allocator.num_used,
            kv_pages_total=self.allocator.total,
        )

    # ---- one step ----
    def step(self) -> list[TokenOutput]:
        """Admit, run one forward pass, sample; returns each scheduled request's new token."""
        admitted = self._admit()
        batch = sorted(self.running.values(), key=lambda r: r.rid)
        if not batch:
            return []
        seqs = [SequenceInput(r.next_input(), r.num_cached, r.pages) for r in batch]
        sampling = SamplingBatch.build(
            [r.params for r in batch],
            [r.seed for r in batch],
            [len(r.output_ids) for r in batch],
            self.engine.model_config.vocab_size,
            self.engine.device,
        )
        tokens = self.engine.step(seqs, sampling)
        outputs = []
        for req, seq, token in zip(batch, seqs, tokens):
            req.num_cached = seq.seq_len
            req.output_ids.append(token)
            req.finish_reason = self._finish_reason(req, token)
            outputs.append(
                TokenOutput(
                    rid=req.rid,
                    token_ids=[token],
                    finish_reason=req.finish_reason,
                    prompt_tokens=len(req.prompt_ids) if req in admitted else 0,
                )
            )
            if req.finished:
                self._release(self.running.pop(req.rid))
        return outputs

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        budget = self.config.max_num_batched_tokens - len(self.running)
        while self.waiting and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            need = self._pages_needed(req)
            if need > self.allocator.num_free:
                break  # FCFS: it waits for pages; later requests do not overtake it
            if len(req.prompt_ids) > budget and (admitted or self.running):
                break
            self.waiting.popleft()
            req.pages = self.allocator.allocate(need)
            budget -= len(req.prompt_ids)
            self.running[req.rid] = req
            admitted.append(req)
        return admitted

    def _pages_needed(self, req: Request) -> int:
        # The whole request is reserved up front, so a running request never runs out of pages.
        return -(-(len(req.prompt_ids) + req.max_new_tokens) // self.page_size)

    def _finish_reason(self, req: Request, token: int) -> str | None:
        params = req.params
        if not params.ignore_eos and token in self.eos_ids:
            return "stop"
        if params.stop_token_ids and token in params.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None

    def _release(self, req: Request) -> None:
        self.allocator.free(req.pages)
        req.pages = []
