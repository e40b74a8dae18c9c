"""Diagnostic: what the GPU does in a pipelined batch-1 decode step outside its CUDA graph.

A Scheduler decodes with overlap scheduling (as ``decode_latency.time_pipelined``) under the torch
profiler. A step starts at the graph's first kernel (the embedding gather) and the graph ends at its
last GEMV (the LM head); between that and the next step's start the GPU runs the sampler, the copies
of inputs and samples and whatever else, or idles. Prints, per step (medians over the full-batch
steps), the step's span, the graph's span and each activity after the graph, with the idle time;
with --in-graph also each kernel inside the graph (by name with its template arguments): launches a
step, median duration, total a step.

    python benchmarks/experiments/step_timeline.py --model tests/data/configs/Qwen3-8B --quantization fp8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import print_table, setup_logging, write_json  # noqa: E402
from decode_latency import time_pipelined  # noqa: E402
from fp8_decode import decode_engine  # noqa: E402

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_FIRST = "indexSelectSmallIndex"  # the embedding gather, the graph's first kernel at a few tokens
GRAPH_LAST = "gemv_kernel"  # the LM head


def gpu_events(prof: profile) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") in GPU_CATEGORIES and "dur" in e]
    return sorted(events, key=lambda e: e["ts"])


def short(name: str) -> str:
    return name.split("<")[0].split("(")[0][:60]


def step_windows(events: list[dict]):
    """Per decode step: (its events up to the next step's start, the index of the graph's last GEMV or None,
    the next step's first event)."""
    starts = [i for i, e in enumerate(events) if STEP_FIRST in e["name"]]
    for a, b in zip(starts, starts[1:]):
        window = events[a:b]
        yield window, max((i for i, e in enumerate(window) if GRAPH_LAST in e["name"]), default=None), events[b]


def graph_kernels(events: list[dict]) -> dict[str, list[float]]:
    """Per kernel name (template arguments kept) inside the graphs: durations, over all steps."""
    durations = defaultdict(list)
    for window, last_gemv, _ in step_windows(events):
        for e in window[: (last_gemv or 0) + 1]:
            name = e["name"].removeprefix("void ").replace("(anonymous namespace)::", "")
            durations[name.split("(")[0][:110]].append(e["dur"])
    return durations


def step_breakdown(events: list[dict]) -> tuple[list[dict], dict[str, list[float]]]:
    """Per decode step (graph start to the next graph start): span, graph span, tail busy and idle;
    and per activity name after the graph, its durations."""
    steps, tail_durations = [], defaultdict(list)
    for window, last_gemv, next_start in step_windows(events):
        if last_gemv is None:
            continue
        graph_end = max(e["ts"] + e["dur"] for e in window[: last_gemv + 1])
        tail = window[last_gemv + 1:]
        busy, cursor = 0.0, graph_end
        for e in tail:
            end = e["ts"] + e["dur"]
            busy += max(0.0, end - max(cursor, e["ts"]))
            cursor = max(cursor, end)
            tail_durations[short(e["name"])].append(e["dur"])
        span = next_start["ts"] - window[0]["ts"]
        steps.append({"span_us": span, "graph_us": graph_end - window[0]["ts"], "tail_us": next_start["ts"] - graph_end,
                      "tail_busy_us": busy, "tail_kernels": len(tail)})
    return steps, tail_durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="directory with a config.json (weights are random)")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--in-graph", action="store_true", help="also each kernel inside the graph")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    setup_logging()
    engine = decode_engine(args.model, args.quantization, 1, args.context, args.warmup, args.iters)
    time_pipelined(engine, 1, args.context, args.warmup, args.iters)  # warm: every kernel compiled
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed = time_pipelined(engine, 1, args.context, args.warmup, args.iters)
    events = gpu_events(prof)
    steps, tail = step_breakdown(events)
    # the steady steps: drop the prefill and the last (their windows hold other work)
    median_span = statistics.median(s["span_us"] for s in steps)
    steady = [s for s in steps if s["span_us"] < 1.5 * median_span]
    summary = {k: statistics.median(s[k] for s in steady) for k in steady[0]}
    n = len(steady)
    rows = [{"activity": name, "per_step": len(d) / n, "median_us": statistics.median(d), "total_per_step_us": sum(d) / n}
            for name, d in sorted(tail.items(), key=lambda kv: -sum(kv[1]))]
    print(f"{args.model} {args.quantization or 'bf16'}: {n} steps; pipelined interval "
          f"{timed[0] * 1e3 if not isinstance(timed, str) else timed} ms (profiled)")
    print_table([summary], list(summary))
    print_table(rows, ["activity", "per_step", "median_us", "total_per_step_us"])
    kernels = []
    if args.in_graph:
        kernels = [{"kernel": name, "per_step": len(d) / n, "median_us": statistics.median(d),
                    "total_per_step_us": sum(d) / n} for name, d in sorted(graph_kernels(events).items(),
                                                                            key=lambda kv: -sum(kv[1]))]
        print_table(kernels, ["kernel", "per_step", "median_us", "total_per_step_us"])
    write_json(args.out, {"benchmark": "step_timeline", "model": args.model, "quantization": args.quantization,
                          "steps": n, "summary": summary, "tail": rows, "graph_kernels": kernels})


if __name__ == "__main__":
    main()
