"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``.

With tp_size 1 the engine runs in this process. With tp_size N it runs one spawned process per
rank; every rank receives the same requests (with the same seeds) and runs the same continuous
batching, and rank 0 sends the results back.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import random
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

import torch
from tqdm import tqdm

from tpserve.config import EngineConfig, ModelConfig, check_can_start
from tpserve.distributed.comm import local_init_addr
from tpserve.message import SchedulerStats
from tpserve.sampling_params import SamplingParams
from tpserve.scheduler.gc_control import frozen_heap

logger = logging.getLogger(__name__)

STARTUP_POLL_SECONDS = 0.5
SHUTDOWN_SECONDS = 10.0


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    # With SamplingParams(logprobs=n): each token's log-probability, and the n most likely
    # (token id, log-probability) pairs at each position.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class _Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    text: str | None = None  # set when stop strings were watched (trimmed at the stop string)


class _StopWatcher:
    """A request's text so far, cut at its first stop string (see ``StopStringFilter``)."""

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        from tpserve.tokenizer.incremental import IncrementalDecoder
        from tpserve.tokenizer.stop import StopStringFilter

        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens=True)
        self._filter = StopStringFilter(params.stop, params.include_stop_str_in_output)
        self.parts: list[str] = []

    def feed(self, token_ids: list[int], final: bool) -> bool:
        """Add tokens; True once a stop string is complete."""
        self.parts.append(self._filter.feed(self._decoder.add(token_ids, final=final), final=final))
        return self._filter.stopped


@dataclass(frozen=True)
class _Job:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int


def run_jobs(scheduler, jobs: list[_Job], show_progress: bool, tokenizer=None) -> dict[int, _Result]:
    """Feed every job to a scheduler and step until all finish. Jobs with stop strings need the
    ``tokenizer``: their text is watched and they are aborted at a stop string. Every TP rank
    runs this on the same tokens, so all ranks abort at the same step."""
    watchers: dict[int, _StopWatcher] = {}
    for job in jobs:
        scheduler.add_request(job.rid, job.prompt_ids, job.params, job.seed)
        if job.params.stop:
            if tokenizer is None:
                raise ValueError("stop strings need the model's tokenizer")
            watchers[job.rid] = _StopWatcher(tokenizer, job.params)
    results = {job.rid: _Result() for job in jobs}
    for out in scheduler.attach_all_grammars():  # compiles them; all ranks start together
        results[out.rid].finish_reason = out.finish_reason
    with tqdm(total=len(jobs), desc="Generating", unit="req", disable=not show_progress) as bar, frozen_heap():
        while scheduler.has_work:
            for out in scheduler.step():
                result = results[out.rid]
                result.token_ids.extend(out.token_ids)
                if out.logprobs is not None:
                    result.logprobs = (result.logprobs or []) + out.logprobs
                    result.top_logprobs = (result.top_logprobs or []) + (out.top_logprobs or [])
                watcher = watchers.get(out.rid)
                if watcher is not None:
                    if watcher.feed(out.token_ids, final=out.finish_reason is not None) and out.finish_reason is None:
                        scheduler.abort(out.rid)
                        out.finish_reason = "stop"
                    result.text = "".join(watcher.parts)
                if out.finish_reason is not None:
                    result.finish_reason = out.finish_reason
                    bar.update(1)
    return results


def _rank_main(config: EngineConfig, rank: int, conn: Connection) -> None:
    """A TP rank's process: build the engine, then serve generate calls until told to stop."""
    from tpserve.engine.engine import Engine
    from tpserve.scheduler.scheduler import Scheduler
    from tpserve.tokenizer.loader import load_tokenizer

    try:
        engine = Engine(config, rank)
        scheduler = Scheduler(engine)
        tokenizer = None
        conn.send(("ready", None))
        while True:
            try:
                command, payload = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                return
            if command == "close":
                break
            try:
                if command == "flush_cache":
                    conn.send(("flushed", scheduler.flush_cache()))
                elif command == "stats":
                    conn.send(("stats", scheduler.stats()))
                else:
                    jobs, use_tqdm = payload
                    if tokenizer is None and any(job.params.stop for job in jobs):
                        tokenizer = load_tokenizer(config.model)
                    results = run_jobs(scheduler, jobs, show_progress=use_tqdm and rank == 0, tokenizer=tokenizer)
                    conn.send(("results", results if rank == 0 else None))
            except Exception as exc:  # report, keep the rank alive for the next call
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
        engine.shutdown()
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass


class _RankProcesses:
    """The spawned rank processes and their pipes; stops them all on close or at exit."""

    def __init__(self, config: EngineConfig) -> None:
        ctx = mp.get_context("spawn")
        config = replace(config, dist_init_addr=local_init_addr())
        self.conns: list[Connection] = []
        self.procs: list[mp.Process] = []
        for rank in range(config.tp_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(config, rank, child_end), name=f"tpserve-rank{rank}", daemon=True)
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs, self.conns)
        try:
            self.receive_all()
        except BaseException:
            self.close()
            raise

    def receive_all(self) -> list[object]:
        """One reply from every rank; raises if any rank reports an error or dies."""
        replies: list[object] = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs)):
            while not conn.poll(STARTUP_POLL_SECONDS):
                if not proc.is_alive():
                    raise RuntimeError(f"tp rank {rank} died (exit code {proc.exitcode})")
                for other, other_proc in enumerate(self.procs):  # a peer dying leaves this one hanging
                    if not other_proc.is_alive() and other != rank:
                        self._raise_from(other)
            try:
                kind, payload = conn.recv()
            except EOFError:
                raise RuntimeError(f"tp rank {rank} died (exit code {proc.exitcode})") from None
            if kind == "error":
                self._raise_if_any_died()  # a dead peer is the root cause of the others' errors
                raise RuntimeError(f"tp rank {rank} failed:\n{payload}")
            replies.append(payload)
        return replies

    def _raise_if_any_died(self) -> None:
        for rank, proc in enumerate(self.procs):
            proc.join(1.0)
            if not proc.is_alive() and proc.exitcode != 0:
                raise RuntimeError(f"tp rank {rank} died (exit code {proc.exitcode})")

    def _raise_from(self, rank: int) -> None:
        conn = self.conns[rank]
        if conn.poll():
            kind, payload = conn.recv()
            if kind == "error":
                raise RuntimeError(f"tp rank {rank} failed:\n{payload}")
        raise RuntimeError(f"tp rank {rank} died (exit code {self.procs[rank].exitcode})")

    def broadcast(self, message: tuple[str, object]) -> None:
        for conn in self.conns:
            conn.send(message)

    def close(self) -> None:
        self._finalizer()


def _stop_processes(procs: list[mp.Process], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send(("close", None))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(SHUTDOWN_SECONDS)
        if proc.is_alive():
            proc.terminate()
            proc.join(2)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


class LLM:
    """Offline generation. ``LLM(model_dir, tp_size=2)`` runs two rank processes on this host."""

    def __init__(
        self,
        model: str,
        tp_size: int = 1,
        device: str | None = None,
        dtype: str | None = None,
        load_format: str = "auto",
        **engine_kwargs,
    ) -> None:
        from tpserve.launch.model_path import resolve_model_dir

        model = resolve_model_dir(model)  # a local directory, or a HF id from the local cache (as the server)
        self.config = EngineConfig(
            model=model, tp_size=tp_size, device=device, dtype=dtype, load_format=load_format, **engine_kwargs
        )
        self.model_config = ModelConfig.from_pretrained(model)
        check_can_start(self.config, self.model_config)  # fail here, before spawning anything
        self.tokenizer = _load_tokenizer(model)
        self._next_rid = 0
        self._seed_rng = random.Random()
        self._ranks: _RankProcesses | None = None
        self._scheduler = None
        self._engine = None
        if tp_size == 1:
            from tpserve.engine.engine import Engine
            from tpserve.scheduler.scheduler import Scheduler

            self._engine = Engine(self.config, rank=0)
            self._scheduler = Scheduler(self._engine)
        else:
            self._ranks = _RankProcesses(self.config)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("prompts must be a list of strings or a list of token-id lists")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        for params in sampling_params:
            self._check_params(params)
        jobs = []
        for prompt, params in zip(prompts, sampling_params):
            ids = self._encode(prompt)
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            jobs.append(_Job(self._next_rid, ids, params, seed))
            self._next_rid += 1
        if self._scheduler is not None:
            results = run_jobs(self._scheduler, jobs, use_tqdm, self.tokenizer)
        elif self._ranks is not None:
            self._ranks.broadcast(("generate", (jobs, use_tqdm)))
            results = self._ranks.receive_all()[0]
        else:
            raise RuntimeError("generate() called after close()")
        return [self._output(job, results[job.rid]) for job in jobs]

    def flush_cache(self) -> bool:
        """Drop every cached prefix; True when the whole KV pool is free again."""
        if self._scheduler is not None:
            return self._scheduler.flush_cache()
        if self._ranks is None:
            raise RuntimeError("flush_cache() called after close()")
        self._ranks.broadcast(("flush_cache", None))
        return all(self._ranks.receive_all())

    def stats(self) -> SchedulerStats:
        """KV pages in use, cached and free; cumulative cache hits, evictions, preemptions."""
        if self._scheduler is not None:
            return self._scheduler.stats()
        if self._ranks is None:
            raise RuntimeError("stats() called after close()")
        self._ranks.broadcast(("stats", None))
        return self._ranks.receive_all()[0]

    def _check_params(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if params.structured is not None:
            from tpserve.structured.grammar import check_spec

            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer; this model has none")
            check_spec(params.structured)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer; this model has none")
        for name, ids in (("stop_token_ids", params.stop_token_ids or []), ("logit_bias", params.logit_bias or {})):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is out of range [0, {vocab})")

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token-id lists")
            return self.tokenizer.encode(prompt)  # with the model's special tokens (e.g. BOS), as the server does
        return [int(t) for t in prompt]

    def _output(self, job: _Job, result: _Result) -> RequestOutput:
        ids = result.token_ids
        text = result.text
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        reason = result.finish_reason or "abort"
        return RequestOutput(job.prompt_ids, ids, text, reason, result.logprobs, result.top_logprobs)

    def close(self) -> None:
        """Stop the rank processes, or free this process's engine (GPU memory included)."""
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None
        if self._scheduler is not None:
            self._scheduler = None
            engine, self._engine = self._engine, None
            engine.shutdown()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        logger.warning("no tokenizer in %s: prompts must be token ids and outputs have no text", model_dir)
        return None
