"""Every TP x DP split of a machine, each evaluated or excluded with its reason."""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.plan.cost import StepCost, decode_step, prefill_seconds
from tpserve.plan.shape import ModelShape
from tpserve.plan.specs import GIB, NETWORK, GPUSpec, Link

# Per GPU, outside the KV cache: the CUDA context, a chunked prefill's activations, CUDA graphs.
RUNTIME_RESERVE_BYTES = 2 * GIB
REFERENCE_BATCH = 64


@dataclass(frozen=True)
class Machine:
    gpu: GPUSpec
    gpus_per_node: int
    nodes: int = 1

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Settings:
    context: int  # tokens each request holds (prompt + completion)
    mem_fraction: float = 0.85  # the engine's --mem-fraction
    max_running_requests: int = 256  # the engine's --max-running-requests
    page_size: int = 16
    quantization: str | None = None  # the engine's --quantization
    kv_cache_dtype: str = "auto"  # the engine's --kv-cache-dtype


@dataclass(frozen=True)
class SplitPlan:
    tp: int
    dp: int  # replicas over the whole machine
    weight_bytes_per_gpu: float
    fits: bool
    kv_tokens: int  # per replica
    requests_per_replica: int  # at the context
    max_batch: int  # per replica: the requests the KV holds, at most --max-running-requests
    decode_1: StepCost | None
    decode_64: StepCost | None
    decode_max: StepCost | None
    prefill: StepCost | None

    @property
    def requests(self) -> int:
        return self.dp * self.requests_per_replica

    @property
    def usable(self) -> bool:
        return self.fits and self.requests_per_replica > 0

    def throughput(self, step: StepCost | None, batch: int) -> float | None:
        """Output tokens/s of the whole machine with every replica decoding ``batch`` sequences."""
        return None if step is None else self.dp * batch / step.seconds

    @property
    def latency_tok_s(self) -> float | None:
        return None if self.decode_1 is None else 1.0 / self.decode_1.seconds

    @property
    def batch64_tok_s(self) -> float | None:
        return self.throughput(self.decode_64, REFERENCE_BATCH)

    @property
    def max_batch_tok_s(self) -> float | None:
        return self.throughput(self.decode_max, self.max_batch)


@dataclass(frozen=True)
class Excluded:
    tp: int
    reason: str


def kv_tokens_per_replica(shape: ModelShape, machine: Machine, tp: int, settings: Settings) -> int:
    budget = machine.gpu.memory_bytes * settings.mem_fraction - shape.weight_bytes_per_rank(tp) - RUNTIME_RESERVE_BYTES
    if budget <= 0:
        return 0
    pages = int(budget // (shape.kv_bytes_per_token(tp) * settings.page_size)) - 1  # the scratch page
    return max(0, pages) * settings.page_size


def link_for(machine: Machine, tp: int) -> Link:
    """A TP group within a node all-reduces over its NVLink; one across nodes over the network."""
    return NETWORK if tp > machine.gpus_per_node else machine.gpu.link


def evaluate(shape: ModelShape, machine: Machine, tp: int, settings: Settings) -> SplitPlan:
    gpu, context, link = machine.gpu, settings.context, link_for(machine, tp)
    weights = shape.weight_bytes_per_rank(tp)
    fits = weights + RUNTIME_RESERVE_BYTES < gpu.memory_bytes * settings.mem_fraction
    kv = kv_tokens_per_replica(shape, machine, tp, settings) if fits else 0
    per_request = -(-context // settings.page_size) * settings.page_size
    requests = kv // per_request
    batch = min(requests, settings.max_running_requests)
    usable = fits and requests > 0
    return SplitPlan(
        tp=tp,
        dp=machine.total_gpus // tp,
        weight_bytes_per_gpu=weights,
        fits=fits,
        kv_tokens=kv,
        requests_per_replica=requests,
        max_batch=batch if usable else 0,
        decode_1=decode_step(shape, gpu, tp, 1, context, link) if usable else None,
        decode_64=decode_step(shape, gpu, tp, REFERENCE_BATCH, context, link) if usable and batch >= REFERENCE_BATCH else None,
        decode_max=decode_step(shape, gpu, tp, batch, context, link) if usable else None,
        prefill=prefill_seconds(shape, gpu, tp, context, link) if fits else None,
    )


def split_reason(shape: ModelShape, machine: Machine, tp: int, settings: Settings) -> str | None:
    """Why TP ``tp`` cannot serve this model on this machine (None: it can)."""
    try:
        shape.config.check_tp_size(tp, name="tp")
    except ValueError as e:
        return str(e)
    if tp > machine.gpus_per_node and tp % machine.gpus_per_node:
        return f"a TP group of {tp} across nodes must take whole nodes of {machine.gpus_per_node} GPUs"
    if tp <= machine.gpus_per_node and machine.gpus_per_node % tp:
        return f"tp {tp} does not divide the {machine.gpus_per_node} GPUs of a node"
    return None


def plan_splits(shape: ModelShape, machine: Machine, settings: Settings) -> tuple[list[SplitPlan], list[Excluded]]:
    plans: list[SplitPlan] = []
    excluded: list[Excluded] = []
    for tp in range(1, machine.total_gpus + 1):
        if machine.total_gpus % tp:
            continue
        reason = split_reason(shape, machine, tp, settings)
        if reason is None:
            plans.append(evaluate(shape, machine, tp, settings))
        else:
            excluded.append(Excluded(tp, reason))
    return plans, excluded


def best_for_latency(plans: list[SplitPlan]) -> SplitPlan | None:
    """The fastest batch-1 step; within 2% of it, the smaller TP (more replicas, less all-reduce)."""
    usable = [p for p in plans if p.usable and p.decode_1 is not None]
    if not usable:
        return None
    fastest = min(p.decode_1.seconds for p in usable if p.decode_1)
    return min((p for p in usable if p.decode_1 and p.decode_1.seconds <= fastest * 1.02), key=lambda p: p.tp)


def best_for_throughput(plans: list[SplitPlan]) -> SplitPlan | None:
    usable = [p for p in plans if p.usable and p.max_batch_tok_s is not None]
    return max(usable, key=lambda p: p.max_batch_tok_s or 0.0) if usable else None
