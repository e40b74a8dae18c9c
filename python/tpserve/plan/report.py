"""The planner's printed report: one row per split, the excluded splits with their reasons, and
a recommendation for latency and one for throughput with the commands that launch them."""

from __future__ import annotations

from tpserve.plan.shape import ModelShape
from tpserve.plan.specs import GIB
from tpserve.plan.splits import Excluded, Machine, Settings, SplitPlan, best_for_latency, best_for_throughput



def _ms(step) -> str:
    return "-" if step is None else f"{step.seconds * 1e3:.2f}"


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _share(step) -> str:
    return "-" if step is None else f"{step.comm_share:.0%}"


def _si(value: float, unit: str) -> str:
    """1.23 TB/s, 45 GB/s, 760 TFLOP/s, 310 GFLOP/s."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def split_name(plan: SplitPlan) -> str:
    return f"TP{plan.tp} x DP{plan.dp}"


def rows(plans: list[SplitPlan]) -> list[dict[str, str]]:
    out = []
    for p in plans:
        out.append({
            "split": split_name(p),
            "weights GiB/GPU": f"{p.weight_bytes_per_gpu / GIB:.1f}",
            "fits": "yes" if p.fits else "no",
            "KV tokens/replica": f"{p.kv_tokens:,}",
            "requests@ctx (all)": f"{p.requests:,}",
            "b1 step ms": _ms(p.decode_1),
            "b1 tok/s": _rate(p.latency_tok_s),
            "b64 tok/s": _rate(p.batch64_tok_s),
            "max batch/replica": str(p.max_batch) if p.decode_max else "-",
            "max-batch tok/s": _rate(p.max_batch_tok_s),
            "prefill ms": _ms(p.prefill),
            "all-reduce b1/b64/max/prefill": "/".join(
                _share(s) for s in (p.decode_1, p.decode_64, p.decode_max, p.prefill)
            ),
        })
    return out


def table(records: list[dict[str, str]]) -> list[str]:
    if not records:
        return []
    columns = list(records[0])
    widths = [max(len(c), *(len(r[c]) for r in records)) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(r[c].rjust(w) for c, w in zip(columns, widths)) for r in records]
    return lines


def _fp8_note(shape: ModelShape) -> str:
    if shape.fp8_block is None:
        return ""
    bn, bk = shape.fp8_block
    return f" (decoder linears FP8: 1 byte each and a float32 scale per {bn}x{bk} block)"


def launch_commands(plan: SplitPlan, model: str, machine: Machine, settings: Settings) -> list[str]:
    """The ``python -m tpserve`` command of each node: its replicas behind one server (``--dp-size``),
    or its part of a TP group that spans nodes."""
    flags = f"--model {model} --tp-size {plan.tp} --max-model-len {settings.context}"
    if machine.gpu.device == "cpu":  # the CPU engine sizes its KV cache from --max-total-tokens only
        flags += f" --device cpu --max-total-tokens {plan.kv_tokens}"
    if settings.mem_fraction != 0.85:
        flags += f" --mem-fraction {settings.mem_fraction}"
    if settings.quantization is not None:
        flags += f" --quantization {settings.quantization}"
    if settings.kv_cache_dtype != "auto":
        flags += f" --kv-cache-dtype {settings.kv_cache_dtype}"
    if plan.tp > machine.gpus_per_node:  # one TP group over several nodes: one launch per node
        nodes = plan.tp // machine.gpus_per_node
        job = f"--nnodes {nodes} --dist-init-addr NODE0_IP:29500"
        return [f"TPSERVE_DIST_TOKEN=$SECRET python -m tpserve {flags} {job} --node-rank {r}   # on node {r}"
                for r in range(nodes)]
    per_node = plan.dp // machine.nodes
    dp = f" --dp-size {per_node}" if per_node > 1 else ""
    return [f"python -m tpserve {flags}{dp}"]


def recommendation(
    title: str, plan: SplitPlan | None, why: str, model: str, machine: Machine, settings: Settings, batch_hint: bool = False
) -> list[str]:
    if plan is None:
        return [f"{title}: none (no split holds the weights and one request at this context)"]
    lines = [f"{title}: {split_name(plan)}: {why}"]
    lines += [f"  {c}" for c in launch_commands(plan, model, machine, settings)]
    per_node = max(1, plan.dp // machine.nodes)
    if plan.tp > machine.gpus_per_node:
        lines.append(f"  ({plan.dp} such group{'s' if plan.dp > 1 else ''} of {plan.tp // machine.gpus_per_node} nodes; "
                     f"see docs/deploy.md)")
    elif machine.nodes > 1:
        replicas = "one replica" if per_node == 1 else f"{per_node} replicas behind its router"
        lines.append(f"  (on each of the {machine.nodes} nodes: {replicas}; put a load balancer in front of the nodes)")
    if batch_hint and plan.requests_per_replica > plan.max_batch:
        lines.append(f"  (the KV cache holds {plan.requests_per_replica:,} requests per replica: a larger "
                     f"--max-running-requests batches more of them)")
    return lines


def render(
    shape: ModelShape,
    model: str,
    machine: Machine,
    settings: Settings,
    plans: list[SplitPlan],
    excluded: list[Excluded],
    workload: str = "chat",
    source: str = "table",
) -> str:
    cfg, gpu = shape.config, machine.gpu
    nodes = f" x {machine.nodes} nodes" if machine.nodes > 1 else ""
    lines = [
        f"model {model}: {shape.params() / 1e9:.2f} B parameters, {shape.weight_bytes_per_rank(1) / GIB:.1f} GiB at "
        f"{shape.dtype_bytes} bytes each{_fp8_note(shape)}, KV {shape.kv_bytes_per_token(1) / 1024:.0f} KiB/token, "
        f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads"
        + (f", MoE: {cfg.moe.num_experts} experts, {cfg.moe.top_k} per token in {len(cfg.moe.layers)} layers" if cfg.moe else ""),
        f"machine: {machine.gpus_per_node} x {gpu.name}{nodes} ({source}): {gpu.memory_bytes / GIB:.0f} GiB, copy "
        f"{_si(gpu.copy_bandwidth, 'B/s')}, matmul {_si(gpu.matmul_flops, 'FLOP/s')}, all-reduce "
        f"{gpu.link.alpha_s * 1e6:.0f} us + {_si(gpu.link.bus_bandwidth, 'B/s')} bus",
        f"context {settings.context:,} tokens; decode figures have every sequence holding the whole context; "
        f"tok/s are the whole machine's output tokens (b1: one request's)",
        "",
        *table(rows(plans)),
    ]
    if excluded:
        lines += ["", "excluded:"] + [f"  TP{e.tp}: {e.reason}" for e in excluded]
    latency, throughput = best_for_latency(plans), best_for_throughput(plans)
    lat = recommendation(
        "latency", latency,
        latency and f"batch-1 step {_ms(latency.decode_1)} ms ({_rate(latency.latency_tok_s)} tok/s per request)",
        model, machine, settings,
    )
    thr = recommendation(
        "throughput", throughput,
        throughput and f"{_rate(throughput.max_batch_tok_s)} tok/s at {throughput.max_batch} requests per replica",
        model, machine, settings, batch_hint=True,
    )
    lines += [""] + (lat + thr if workload == "chat" else thr + lat)
    unfit = [p for p in plans if not p.fits]
    if unfit and not any(p.fits for p in plans):
        need = min(p.weight_bytes_per_gpu for p in unfit)
        lines.append(f"the weights fit no split: the smallest share is {need / GIB:.1f} GiB per GPU, above "
                     f"{settings.mem_fraction:.0%} of {gpu.memory_bytes / GIB:.0f} GiB less the runtime's reserve")
    return "\n".join(lines)
