"""Where a decode step's time goes: the CUDA graph's GPU time, the host's planning, sampling and
sync around it, and (eager) how many kernels one forward launches and how long they run, by
kind (GEMMs, attention, all-reduce, ...). At ``--tp-size N`` every rank runs the same steps in
its own process and rank 0's figures are printed.

    python benchmarks/profile_decode.py --model ../shared/models/configs/Qwen3-8B --batch-sizes 1,64
    python benchmarks/profile_decode.py --model ../shared/models/configs/Qwen3-32B --tp-size 2 --batch-sizes 1,64,256
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from functools import partial

import torch
from common import (
    engine_step,
    fill_kv_randomly,
    on_ranks,
    print_table,
    setup_logging,
    time_cuda,
    trace_kernels,
    write_json,
)
from torch.profiler import ProfilerActivity, profile
from tpserve.engine_config import EngineConfig
from tpserve.forward import SequenceInput
from tpserve.engine.sampler import SamplingBatch
from tpserve.kvcache.pool import PageAllocator
from tpserve.sampling_params import SamplingParams


def sample_and_sync(sampler, logits: torch.Tensor, sampling: SamplingBatch) -> list[int]:
    return sampler(logits, sampling).tolist()


def wall(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# Kernel name patterns, first match wins; "other" takes the rest.
CATEGORIES = {
    "moe": r"_grouped_gemm|_router_topk|_align_kernel|_expert_count_kernel|moe",
    "allreduce": r"nccl|[Aa]ll[Rr]educe|all_reduce|one_shot|two_shot|[Aa]ll[Gg]ather",
    "attention": r"BatchDecode|BatchPrefill|PersistentVariableLength|MergeStates|decode_kernel|prefill",
    "gemm": r"gemm|gemv|cutlass|cublas|nvjet|sm90_xmma|splitKreduce",
    "rope_store": r"rope_store|rope|kv_kernel",  # before "norm": the fused kernel's name has both
    "norm": r"[Nn]orm",
    "activation": r"silu|act_and_mul",
    "embedding": r"embedding|index_select|indexSelect",
}


def kernel_categories(kernels: list) -> dict[str, tuple[int, float]]:
    """(kernel count, device microseconds) per category of one forward's kernels."""
    totals = {name: [0, 0.0] for name in [*CATEGORIES, "other"]}
    for event in kernels:
        name = next((c for c, pattern in CATEGORIES.items() if re.search(pattern, event.name)), "other")
        totals[name][0] += 1
        totals[name][1] += event.device_time_total
    return {name: (count, micros) for name, (count, micros) in totals.items()}


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and parameter list."""
    name = re.sub(r"\(.*", "", name.replace("(anonymous namespace)::", ""))
    depth, out = 0, []
    for ch in name:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">"
    return "".join(out).replace("void ", "").split("::")[-1][:60]


def graph_timeline(replay, replays: int = 3) -> tuple[list[dict], float]:
    """The kernels of the last of ``replays`` CUDA graph replays in launch order (name, start and
    duration in us; start relative to the first) and the replay's span in us. PDL lets a kernel
    start before the previous one ends, so a gap may be negative."""
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    events = trace_kernels(prof)
    last = events[len(events) - len(events) // replays:]
    t0 = last[0]["ts"]
    kernels = [{"name": short_name(e["name"]), "start_us": e["ts"] - t0, "dur_us": e["dur"]} for e in last]
    span = max(k["start_us"] + k["dur_us"] for k in kernels)
    return kernels, span


def timeline_summary(kernels: list[dict], span: float, verbose: bool) -> dict:
    """Busy time, gaps, and time per kernel name of one replay; printed when verbose."""
    gaps, end = [], 0.0
    for k in kernels:
        gaps.append(k["start_us"] - end)
        end = max(end, k["start_us"] + k["dur_us"])
    by_name: dict[str, list[float]] = {}
    for k, gap in zip(kernels, gaps):
        entry = by_name.setdefault(k["name"], [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += k["dur_us"]
        entry[2] += gap
    summary = {"graph_kernels": len(kernels), "graph_span_us": span,
               "graph_busy_us": sum(k["dur_us"] for k in kernels),
               "graph_gap_us": sum(g for g in gaps[1:] if g > 0), "graph_overlap_us": -sum(g for g in gaps if g < 0)}
    if verbose:
        print(f"graph replay: {summary}")
        print(f"{'kernel':60s} {'n':>5s} {'total us':>9s} {'mean us':>8s} {'gap before, total us':>21s}")
        for name, (n, total, gap) in sorted(by_name.items(), key=lambda item: -item[1][1]):
            print(f"{name:60s} {n:5d} {total:9.1f} {total / n:8.2f} {gap:21.1f}")
        print("kernels 40-79 and the last 3 of the replay (start, duration, gap before, us):")
        for k, gap in list(zip(kernels, gaps))[40:80] + list(zip(kernels, gaps))[-3:]:
            print(f"  {k['start_us']:9.2f} {k['dur_us']:7.2f} {gap:7.2f}  {k['name']}")
    summary["by_name"] = {name: {"n": n, "total_us": total, "gap_us": gap} for name, (n, total, gap) in by_name.items()}
    return summary


def profile_batches(engine, sizes: list[int], context: int, graph_only: bool = False) -> list[dict]:
    """Every rank runs this; only rank 0 prints."""
    verbose = engine.tp.rank == 0
    fill_kv_randomly(engine)
    runner = engine.graph_runner
    allocator = PageAllocator(engine.num_pages)
    rows = []
    for batch in sizes:
        tables = [allocator.allocate(-(-(context + 1) // engine.page_size)) for _ in range(batch)]
        seqs = [SequenceInput([7], context, t) for t in tables]
        sampling = SamplingBatch.build(
            [SamplingParams(temperature=0.0)] * batch, [0] * batch, [0] * batch,
            engine.model_config.vocab_size, engine.device,
        )
        size = runner.sizes[next(i for i, s in enumerate(runner.sizes) if s >= batch)]
        graph = runner.graphs[size]
        row = {"batch": batch}
        row["step_graph_ms"] = wall(partial(engine_step, engine, seqs, sampling)) * 1e3
        row["replay_gpu_ms"] = time_cuda(graph.graph.replay, warmup=3, iters=20) * 1e3
        row["graph"] = timeline_summary(*graph_timeline(graph.graph.replay), verbose)
        if graph_only:
            rows.append(row)
            for t in tables:
                allocator.free(t)
            continue
        row["plan_host_ms"] = wall(partial(engine.attention.plan_cuda_graph, seqs, graph.attn_meta, size)) * 1e3
        logits = runner.run(seqs)
        row["sample_sync_ms"] = wall(partial(sample_and_sync, engine.sampler, logits, sampling)) * 1e3
        engine.graph_runner = None
        row["step_eager_ms"] = wall(partial(engine_step, engine, seqs, sampling)) * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.forward(seqs)
            torch.cuda.synchronize()
        engine.graph_runner = runner
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        row["eager_kernels"] = len(kernels)
        row["eager_kernel_ms"] = sum(e.device_time_total for e in kernels) / 1e3
        for category, (count, micros) in kernel_categories(kernels).items():
            row[f"{category}_ms"] = micros / 1e3
            row[f"{category}_n"] = count
        rows.append(row)
        if verbose:
            print(row, flush=True)
            top = prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=60)
            print(f"eager forward, batch {batch}: top kernels\n{top}", flush=True)
        for t in tables:
            allocator.free(t)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--all-reduce", default="auto", help="the engine's --all-reduce mode")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--quantization", default=None, help="fp8: quantize the weights at load (issue 16)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8_e4m3")
    parser.add_argument("--graph-only", action="store_true",
                        help="only the CUDA graph's kernel timeline (no eager profile)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    setup_logging()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    config = EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", tp_size=args.tp_size,
                          all_reduce=args.all_reduce, cuda_graph_max_bs=max(sizes),
                          quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    rows = on_ranks(config, profile_batches, sizes, args.context, args.graph_only)
    print(f"\nDecode step breakdown; model {args.model}; TP {args.tp_size}; context {args.context}; "
          f"quantization {args.quantization}; KV {args.kv_cache_dtype}")
    print_table(rows, [c for c in rows[0] if c != "graph"])
    write_json(args.out, {"benchmark": "profile_decode", "model": args.model, "tp_size": args.tp_size,
                          "context": args.context, "quantization": args.quantization,
                          "kv_cache_dtype": args.kv_cache_dtype, "rows": rows})


if __name__ == "__main__":
    main()
