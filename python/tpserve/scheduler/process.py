"""Entry point of a scheduler process (one per TP rank)."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import time

import torch
import torch.distributed as dist

from tpserve.engine_config import EngineConfig
from tpserve.distributed.nodes import NodeFailure, NodeGroup, NodeLayout
from tpserve.launch.child import ChildCannotGoOn
from tpserve.message import (
    AbortRequest,
    BatchTokenOutput,
    FlushCache,
    GenerateRequest,
    GetStats,
    GrammarReady,
    LoadLoRA,
    LoRAAnswer,
    SchedulerInput,
    Shutdown,
    TokenOutput,
    UnloadLoRA,
)
from tpserve.message.endpoints import Endpoints
from tpserve.scheduler.gc_control import freeze_startup_heap
from tpserve.scheduler.io import LocalIO, SchedulerIO
from tpserve.scheduler.scheduler import AdmissionError, Scheduler

logger = logging.getLogger("tpserve.scheduler")

LOG_INTERVAL_S = 10.0
COMPILE_POLL_S = 0.002  # how often an otherwise idle rank 0 looks at grammars being compiled


def run_scheduler(
    engine_config: EngineConfig,
    rank: int,
    endpoints: Endpoints,
    ack_queue: mp.Queue,
    heartbeat: "mp.sharedctypes.Synchronized[float] | None" = None,
) -> None:
    """One rank's process. The first rank of each node acknowledges once every rank is ready."""
    if engine_config.nnodes == 1:
        _run_rank(engine_config, rank, endpoints, ack_queue, heartbeat, None)
        return
    try:
        nodes = NodeGroup.join(rank, engine_config)
    except NodeFailure as e:  # nothing to tell the others: the group never formed
        logger.error("%s", e)
        raise ChildCannotGoOn(str(e)) from None  # the parent's summary names it
    try:
        _run_rank(engine_config, rank, endpoints, ack_queue, heartbeat, nodes)
    except Exception as e:  # noqa: BLE001 - whatever stops a rank stops the job, with a verdict
        nodes.fail(e)


def _run_rank(
    engine_config: EngineConfig,
    rank: int,
    endpoints: Endpoints,
    ack_queue: mp.Queue,
    heartbeat: "mp.sharedctypes.Synchronized[float] | None",
    nodes: NodeGroup | None,
) -> None:
    from tpserve.engine.engine import Engine

    try:
        engine = Engine(engine_config, rank, nodes)
    except ValueError as e:  # a model the checks before start-up could not judge whole (a tensor's shape)
        if nodes is not None:
            raise  # NodeGroup.fail tells every node
        logger.error("tp rank %d cannot start: %s", rank, e)
        raise ChildCannotGoOn(f"tp rank {rank} cannot start: {e}") from None
    if nodes is not None:  # a node may still compile kernels or capture graphs: no deadline here
        nodes.barrier("engine-ready")
    scheduler = Scheduler(engine)
    io = SchedulerIO(rank, engine_config.tp_size, endpoints, engine.cpu_group, nodes)
    io.wait_for_peers()
    if nodes is not None:
        nodes.start_serving(None, engine.cpu_group)
    layout = NodeLayout.of(engine_config)
    if rank == 0:
        replica = f" (replica {engine_config.dp_rank})" if engine_config.dp_size > 1 else ""
        ack_queue.put(f"scheduler ready{replica}: {engine_config.tp_size} rank(s), {scheduler.allocator.total} KV pages")
    elif layout.local_rank(rank) == 0:
        ranks = layout.ranks_on(layout.node_of(rank))
        ack_queue.put(f"node {layout.node_of(rank)}: ranks {ranks.start}-{ranks.stop - 1} ready "
                      f"({engine_config.tp_size} ranks on {layout.nnodes} nodes)")
    freeze_startup_heap()
    loop = SchedulerLoop(scheduler, io, engine_config.debug_check_invariants, heartbeat)
    if nodes is None:
        try:
            loop.run()
        finally:
            scheduler.close()
            io.close()
            engine.shutdown()
        return
    loop.run()  # an exception goes to NodeGroup.fail, which exits at once (collectives may be broken)
    nodes.stop()  # Shutdown reached every rank: the store going away is no failure now
    scheduler.close()
    io.close()
    engine.shutdown()


def every_rank(value: str | None, cpu_group: dist.ProcessGroup | None) -> list[str | None]:
    """Every rank's ``value``, in rank order (a collective: every rank calls it; just ``value`` at tp 1)."""
    if cpu_group is None:
        return [value]
    values: list[str | None] = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(values, value, group=cpu_group)
    return values


class SchedulerLoop:
    """A rank's loop: take the new messages (the same on every rank), step, send the outputs; run
    until Shutdown, or stepped by the offline LLM at tp 1 (``LocalRank``)."""

    def __init__(self, scheduler: Scheduler, io: SchedulerIO | LocalIO, check_ranks: bool, heartbeat=None) -> None:
        self.scheduler = scheduler
        self.heartbeat = heartbeat  # shared double: the time of the last loop iteration
        self.io = io
        self.check_ranks = check_ranks
        self.generated_since_log = 0
        self.last_log = time.monotonic()

    def run(self) -> None:
        self.io.send(BatchTokenOutput([], self.scheduler.stats()))  # /metrics shows the pool at once
        while self.run_once():  # the process dies with its parent (tpserve.launch.child)
            pass

    def run_once(self) -> bool:
        """One iteration; False once a Shutdown arrived."""
        if self.heartbeat is not None:
            self.heartbeat.value = time.monotonic()
        replies: list[TokenOutput] = []
        compiling = bool(self.scheduler.compiling)
        ready = [GrammarReady(rid, timed_out) for rid, timed_out in self.scheduler.grammars_ready()] if self.io.rank == 0 else []
        if compiling and not ready and not self.scheduler.has_work:
            time.sleep(COMPILE_POLL_S)
        for msg in self.io.receive(blocking=not self.scheduler.has_work and not compiling, local=ready):
            if isinstance(msg, Shutdown):
                return False
            replies.extend(self.apply(msg))
        outputs = self.scheduler.step() if self.scheduler.has_work else []
        if self.check_ranks:  # every iteration: ranks that disagree on whether there were outputs are caught too
            self.check_agreement(outputs)
        replies.extend(outputs)
        if replies:
            self.io.send(BatchTokenOutput(replies, self.scheduler.stats()))
        self.maybe_log(sum(len(out.token_ids) for out in outputs))
        return True

    def apply(self, msg: SchedulerInput) -> list[TokenOutput]:
        if isinstance(msg, GrammarReady):
            return self.scheduler.attach_grammar(msg.rid, msg.timed_out)
        if isinstance(msg, GenerateRequest):
            try:
                seed = msg.params.seed if msg.params.seed is not None else msg.rid
                self.scheduler.add_request(msg.rid, msg.input_ids, msg.params, seed)
            except AdmissionError as exc:
                return [TokenOutput(msg.rid, [], "error", prompt_tokens=len(msg.input_ids), error=str(exc))]
        elif isinstance(msg, AbortRequest):
            if self.scheduler.abort(msg.rid):
                return [TokenOutput(msg.rid, [], "abort")]
        elif isinstance(msg, FlushCache):
            flushed = self.scheduler.flush_cache()
            logger.info("prefix cache flushed (%s)", "pool fully free" if flushed else "requests still running")
            self.io.send(BatchTokenOutput([], self.scheduler.stats(), answers="flush_cache", flushed=flushed))
        elif isinstance(msg, GetStats):
            self.io.send(BatchTokenOutput([], self.scheduler.stats(), answers="get_stats"))
        elif isinstance(msg, (LoadLoRA, UnloadLoRA)):
            self.io.send(BatchTokenOutput([], self.scheduler.stats(), answers=msg.__struct_config__.tag,
                                          lora=LoRAAnswer(msg.rid, self._update_lora(msg))))
        return []

    def _update_lora(self, msg: LoadLoRA | UnloadLoRA) -> str | None:
        """Why the load or unload failed on some rank, or None. Each rank reads the adapter's files itself (another
        node's copy may be missing or damaged), so the ranks agree first: a load that failed anywhere is undone on
        the ranks that did it, or their books and batches would differ."""
        error = self._try_update_lora(msg)
        errors = every_rank(error, self.io.cpu_group)
        failed = next(((rank, e) for rank, e in enumerate(errors) if e is not None), None)
        if failed is None:
            return None
        if error is None and isinstance(msg, LoadLoRA):  # no step ran since: no request uses its slot
            self.scheduler.unload_lora(msg.name)
        rank, first = failed
        return first if rank == self.io.rank else f"tp rank {rank}: {first}"

    def _try_update_lora(self, msg: LoadLoRA | UnloadLoRA) -> str | None:
        try:
            if isinstance(msg, LoadLoRA):
                self.scheduler.load_lora(msg.name, msg.path)
            else:
                self.scheduler.unload_lora(msg.name)
        except Exception as e:  # the adapter's files are the user's: a damaged one (safetensors' own error) too
            return str(e) or type(e).__name__
        return None

    def check_agreement(self, outputs: list[TokenOutput]) -> None:
        """Debug mode: every rank must have scheduled and sampled exactly the same."""
        if self.io.cpu_group is None:
            return
        digest = hashlib.sha256(repr([(o.rid, o.token_ids, o.finish_reason) for o in outputs]).encode()).digest()
        mine = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.io.tp_size)]
        dist.all_gather(every, mine, group=self.io.cpu_group)
        if any(int(x) != int(mine) for x in every):
            raise RuntimeError(f"TP ranks disagree on this step's batch: {[int(x) for x in every]}")

    def maybe_log(self, generated: int) -> None:
        self.generated_since_log += generated
        now = time.monotonic()
        if self.io.rank != 0 or now - self.last_log < LOG_INTERVAL_S:
            return
        stats = self.scheduler.stats()
        if self.generated_since_log or stats.running or stats.waiting:
            logger.info(
                "running %d, waiting %d, KV pages %d/%d, %.1f generated tok/s",
                stats.running, stats.waiting, stats.kv_pages_used, stats.kv_pages_total,
                self.generated_since_log / (now - self.last_log),
            )
        self.generated_since_log = 0
        self.last_log = now
