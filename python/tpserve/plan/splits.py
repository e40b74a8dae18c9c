"""Every TP x DP split of a machine, evaluated or excluded with its reason, and the printed report:
one row per split and a recommendation for latency and one for throughput with their commands."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tpserve.plan.cost import GIB, NETWORK, GPUSpec, ModelShape, StepCost, decode_step, prefill_seconds

# Per GPU, outside the KV cache: the CUDA context, a chunked prefill's activations, CUDA graphs.
RUNTIME_RESERVE_BYTES = 2 * GIB
REFERENCE_BATCH = 64
PAGE_SIZE = 16  # the engine's default --page-size


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
    """The engine's flags the plan follows (at the engine's defaults unless given), and the tokens each request holds
    (prompt + completion)."""

    context: int
    mem_fraction: float = 0.85
    max_running_requests: int = 256
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"


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
    # whole experts per rank (--expert-parallel): TP cannot cut them. A decode step is costed with the busiest
    # rank's experts (ModelShape.touched_experts)
    expert_parallel: bool = False

    def throughput(self, step: StepCost | None, batch: int) -> float | None:
        """Output tokens/s of the whole machine with every replica decoding ``batch`` sequences."""
        return None if step is None else self.dp * batch / step.seconds

    @property
    def latency_tok_s(self) -> float | None:
        return None if self.decode_1 is None else 1.0 / self.decode_1.seconds

    @property
    def max_batch_tok_s(self) -> float | None:
        return self.throughput(self.decode_max, self.max_batch)


@dataclass(frozen=True)
class Excluded:
    tp: int
    reason: str


def evaluate(shape: ModelShape, machine: Machine, tp: int, settings: Settings, expert_parallel: bool = False) -> SplitPlan:
    shape = dataclasses.replace(shape, expert_parallel=expert_parallel)
    gpu, context = machine.gpu, settings.context
    link = NETWORK if tp > machine.gpus_per_node else gpu.link  # a TP group across nodes: the network
    weights = shape.weight_bytes_per_rank(tp)
    memory = gpu.memory_bytes * settings.mem_fraction
    fits = weights + RUNTIME_RESERVE_BYTES < memory
    kv_budget = memory - weights - RUNTIME_RESERVE_BYTES
    kv = 0
    if fits and kv_budget > 0:
        pages = int(kv_budget // (shape.kv_bytes_per_token(tp) * PAGE_SIZE)) - 1  # the scratch page
        kv = max(0, pages) * PAGE_SIZE
    per_request = -(-context // PAGE_SIZE) * PAGE_SIZE
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
        decode_64=(decode_step(shape, gpu, tp, REFERENCE_BATCH, context, link)
                   if usable and batch >= REFERENCE_BATCH else None),
        decode_max=decode_step(shape, gpu, tp, batch, context, link) if usable else None,
        prefill=prefill_seconds(shape, gpu, tp, context, link) if fits else None,
        expert_parallel=expert_parallel,
    )


def split_reason(shape: ModelShape, machine: Machine, tp: int, expert_parallel: bool = False) -> str | None:
    """Why TP ``tp`` cannot serve this model on this machine (None: it can)."""
    try:
        shape.config.check_tp_size(tp, name="tp", expert_parallel=expert_parallel)
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
        reason = split_reason(shape, machine, tp)
        if reason is None:
            plans.append(evaluate(shape, machine, tp, settings))
        elif shape.config.moe is not None and split_reason(shape, machine, tp, expert_parallel=True) is None:
            plans.append(evaluate(shape, machine, tp, settings, expert_parallel=True))  # the experts kept whole
        else:
            excluded.append(Excluded(tp, reason))
    return plans, excluded


def best_for_latency(plans: list[SplitPlan]) -> SplitPlan | None:
    """The fastest batch-1 step; within 2% of it, the smaller TP (more replicas, less all-reduce)."""
    usable = [p for p in plans if p.decode_1 is not None]
    if not usable:
        return None
    fastest = min(p.decode_1.seconds for p in usable)
    return min((p for p in usable if p.decode_1.seconds <= fastest * 1.02), key=lambda p: p.tp)


def best_for_throughput(plans: list[SplitPlan]) -> SplitPlan | None:
    usable = [p for p in plans if p.max_batch_tok_s is not None]
    return max(usable, key=lambda p: p.max_batch_tok_s) if usable else None


def _ms(step: StepCost | None) -> str:
    return "-" if step is None else f"{step.seconds * 1e3:.2f}"


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _si(value: float, unit: str) -> str:
    """1.23 TB/s, 45 GB/s, 760 TFLOP/s, 310 GFLOP/s."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def table(plans: list[SplitPlan]) -> list[str]:
    """One right-aligned row per split under a header."""
    if not plans:
        return []
    records = [{
        "split": f"TP{p.tp}{' EP' if p.expert_parallel else ''} x DP{p.dp}",
        "weights GiB/GPU": f"{p.weight_bytes_per_gpu / GIB:.1f}",
        "fits": "yes" if p.fits else "no",
        "KV tokens/replica": f"{p.kv_tokens:,}",
        "requests@ctx (all)": f"{p.dp * p.requests_per_replica:,}",
        "b1 step ms": _ms(p.decode_1),
        "b1 tok/s": _rate(p.latency_tok_s),
        "b64 tok/s": _rate(p.throughput(p.decode_64, REFERENCE_BATCH)),
        "max batch/replica": str(p.max_batch) if p.decode_max else "-",
        "max-batch tok/s": _rate(p.max_batch_tok_s),
        "prefill ms": _ms(p.prefill),
        "all-reduce b1/b64/max/prefill": "/".join(
            "-" if s is None else f"{s.comm_share:.0%}" for s in (p.decode_1, p.decode_64, p.decode_max, p.prefill)
        ),
    } for p in plans]
    widths = {c: max(len(c), *(len(r[c]) for r in records)) for c in records[0]}
    lines = ["  ".join(c.rjust(w) for c, w in widths.items())]
    return lines + ["  ".join(r[c].rjust(w) for c, w in widths.items()) for r in records]


def launch_commands(plan: SplitPlan, model: str, machine: Machine, settings: Settings) -> list[str]:
    """The ``python -m tpserve`` command of each node: its replicas behind one server (``--dp-size``),
    or its part of a TP group that spans nodes."""
    flags = f"--model {model} --tp-size {plan.tp} --max-model-len {settings.context}"
    if machine.gpu.device == "cpu":  # the CPU engine sizes its KV cache from --max-total-tokens only
        flags += f" --device cpu --max-total-tokens {plan.kv_tokens}"
    if settings.dtype != Settings.dtype:
        flags += f" --dtype {settings.dtype}"
    if settings.mem_fraction != Settings.mem_fraction:
        flags += f" --mem-fraction {settings.mem_fraction}"
    if settings.max_running_requests != Settings.max_running_requests:
        flags += f" --max-running-requests {settings.max_running_requests}"
    if settings.quantization is not None:
        flags += f" --quantization {settings.quantization}"
    if settings.kv_cache_dtype != "auto":
        flags += f" --kv-cache-dtype {settings.kv_cache_dtype}"
    if plan.expert_parallel:
        flags += " --expert-parallel"
    if plan.tp > machine.gpus_per_node:
        nodes = plan.tp // machine.gpus_per_node
        job = f"--nnodes {nodes} --dist-init-addr NODE0_IP:29500"
        return [f"TPSERVE_DIST_TOKEN=$SECRET python -m tpserve {flags} {job} --node-rank {r}   # on node {r}"
                for r in range(nodes)]
    per_node = plan.dp // machine.nodes
    dp = f" --dp-size {per_node}" if per_node > 1 else ""
    return [f"python -m tpserve {flags}{dp}"]


def recommendation(title: str, plan: SplitPlan | None, model: str, machine: Machine, settings: Settings) -> list[str]:
    """The ``latency`` or ``throughput`` pick, why, and the commands that launch it."""
    if plan is None:
        return [f"{title}: none (no split holds the weights and one request at this context)"]
    if title == "latency":
        why = f"batch-1 step {_ms(plan.decode_1)} ms ({_rate(plan.latency_tok_s)} tok/s per request)"
    else:
        why = f"{_rate(plan.max_batch_tok_s)} tok/s at {plan.max_batch} requests per replica"
    lines = [f"{title}: TP{plan.tp}{' with expert parallelism' if plan.expert_parallel else ''} x DP{plan.dp}: {why}"]
    lines += [f"  {c}" for c in launch_commands(plan, model, machine, settings)]
    per_node = max(1, plan.dp // machine.nodes)
    if plan.tp > machine.gpus_per_node:
        lines.append(f"  ({plan.dp} such group{'s' if plan.dp > 1 else ''} of {plan.tp // machine.gpus_per_node} nodes; "
                     f"see docs/deploy.md)")
    elif machine.nodes > 1:
        replicas = "one replica" if per_node == 1 else f"{per_node} replicas behind its router"
        lines.append(f"  (on each of the {machine.nodes} nodes: {replicas}; put a load balancer in front of the nodes)")
    if title == "throughput" and plan.requests_per_replica > plan.max_batch:
        lines.append(f"  (the KV cache holds {plan.requests_per_replica:,} requests per replica: a larger "
                     f"--max-running-requests batches more of them)")
    return lines


def render(shape: ModelShape, model: str, machine: Machine, settings: Settings, plans: list[SplitPlan],
           excluded: list[Excluded], workload: str, source: str) -> str:
    cfg, gpu = shape.config, machine.gpu
    nodes = f" x {machine.nodes} nodes" if machine.nodes > 1 else ""
    fp8 = ""
    if shape.fp8_block is not None:
        bn, bk = shape.fp8_block
        experts = ("" if cfg.moe is None else ", experts too" if shape.fp8_experts else ", experts in the serving dtype")
        scales = "a row" if shape.fp8_row_scales else f"per {bn}x{bk} block"
        fp8 = f" (decoder linears FP8: 1 byte each and a float32 scale {scales}{experts})"
    moe = ""
    if cfg.moe is not None:
        moe = f", MoE: {cfg.moe.num_experts} experts, {cfg.moe.top_k} per token in {len(cfg.moe.layers)} layers"
    lines = [
        f"model {model}: {shape.params() / 1e9:.2f} B parameters, {shape.weight_bytes_per_rank(1) / GIB:.1f} GiB at "
        f"{shape.dtype_bytes} bytes each{fp8}, KV {shape.kv_bytes_per_token(1) / 1024:.0f} KiB/token, "
        f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads{moe}",
        f"machine: {machine.gpus_per_node} x {gpu.name}{nodes} ({source}): {gpu.memory_bytes / GIB:.0f} GiB, copy "
        f"{_si(gpu.copy_bandwidth, 'B/s')}, matmul {_si(gpu.matmul_flops, 'FLOP/s')}, all-reduce "
        f"{gpu.link.alpha_s * 1e6:.0f} us + {_si(gpu.link.bus_bandwidth, 'B/s')} bus",
        f"context {settings.context:,} tokens; decode figures have every sequence holding the whole context; "
        f"tok/s are the whole machine's output tokens (b1: one request's)",
        "",
        *table(plans),
    ]
    if excluded:
        lines += ["", "excluded:"] + [f"  TP{e.tp}: {e.reason}" for e in excluded]
    lat = recommendation("latency", best_for_latency(plans), model, machine, settings)
    thr = recommendation("throughput", best_for_throughput(plans), model, machine, settings)
    lines += [""] + (lat + thr if workload == "chat" else thr + lat)
    if plans and not any(p.fits for p in plans):
        need = min(p.weight_bytes_per_gpu for p in plans)
        lines.append(f"the weights fit no split: the smallest share is {need / GIB:.1f} GiB per GPU, above "
                     f"{settings.mem_fraction:.0%} of {gpu.memory_bytes / GIB:.0f} GiB less the runtime's reserve")
    return "\n".join(lines)
