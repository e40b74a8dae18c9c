"""Decode step time against the memory floor.

For each context length and batch size, ``batch`` sequences sit at ``context`` cached tokens and
decode greedily for a few steps through ``common.engine_step`` (forward, sampling and the host
sync, the way the scheduler calls it). The floor is the bytes one step must read (every weight once plus
every sequence's KV) over the device-copy bandwidth measured in this run.

Mode ``pipelined`` measures decode the way the engine really runs: a fresh ``Scheduler`` on the
same engine (overlap scheduling, CUDA graphs when captured) gets ``batch`` requests of ``context``
random prompt tokens, prefills them (untimed) and decodes greedily; ``pipelined_ms`` is the median
wall interval between the starts of consecutive full-batch decode steps after the warm-up (the
engine's inter-token time) and ``pipelined_gpu_ms`` the median device time of those steps.

    python benchmarks/decode_latency.py --model ../shared/models/configs/Qwen3-8B \
        --batch-sizes 1,64 --contexts 512 --modes graph,eager --out out/decode_8b.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from common import (
    copy_bandwidth,
    engine_step,
    fill_kv_randomly,
    kv_bytes_per_token,
    make_engine,
    print_table,
    setup_logging,
    weight_bytes_per_decode_step,
    write_json,
)
from step_trace import StepTracer
from tpserve.forward import SequenceInput
from tpserve.engine.engine import Engine
from tpserve.engine.sampler import SamplingBatch
from tpserve.kvcache.pool import PageAllocator
from tpserve.sampling_params import SamplingParams
from tpserve.scheduler.scheduler import Scheduler


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def time_decode(engine: Engine, batch: int, context: int, warmup: int, iters: int) -> float | None:
    """Median wall seconds per decode step, or None when the KV cache cannot hold the batch."""
    page_size = engine.page_size
    pages_per_seq = -(-(context + warmup + iters + 1) // page_size)
    allocator = PageAllocator(engine.num_pages)
    if batch * pages_per_seq > allocator.num_free:
        return None
    tables = [allocator.allocate(pages_per_seq) for _ in range(batch)]
    rng = random.Random(batch * 100003 + context)
    tokens = [rng.randrange(1000) for _ in range(batch)]
    sampling = SamplingBatch.build(
        [SamplingParams(temperature=0.0)] * batch, [0] * batch, [0] * batch,
        engine.model_config.vocab_size, engine.device,
    )
    times = []
    for step in range(warmup + iters):
        seqs = [SequenceInput([t], context + step, table) for t, table in zip(tokens, tables)]
        start = time.perf_counter()
        tokens = engine_step(engine, seqs, sampling)
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def time_pipelined(engine: Engine, batch: int, context: int, warmup: int, iters: int) -> tuple[float, float | None] | str:
    """(median wall seconds between the starts of consecutive full-batch decode steps, median
    device ms of those steps or None without CUDA) with a Scheduler driving the engine, or why
    the point cannot run."""
    config = engine.config
    if batch > config.max_running_requests:
        return "over max_running_requests"
    budget = config.chunked_prefill_size if config.chunked_prefill_size > 0 else batch * context
    # The first requests start decoding while the last ones still prefill: one extra token per
    # prefill step keeps warmup + iters full-batch decode steps (and one after them).
    prefill_steps = -(-batch * context // budget) + 1
    max_tokens = warmup + iters + 2 + prefill_steps
    pages_per_seq = -(-(context + max_tokens + 1) // engine.page_size)
    if batch * pages_per_seq > engine.num_pages - 1 or context + max_tokens > engine.max_model_len:
        return "no KV room"
    scheduler = Scheduler(engine)  # fresh: its own page allocator and prefix cache
    rng = random.Random(batch * 100003 + context)
    vocab = min(engine.model_config.vocab_size, 10000)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    for rid in range(batch):
        scheduler.add_request(rid, [rng.randrange(vocab) for _ in range(context)], params, seed=rid)
    with StepTracer() as tracer:
        while scheduler.has_work:
            scheduler.step()
    if not scheduler.flush_cache():
        raise RuntimeError("pipelined run left KV pages in use")
    records = tracer.records
    full = [i for i, r in enumerate(records) if r.decode_seqs == batch and r.num_seqs == batch]
    chosen = [i for i in full[warmup : warmup + iters] if i + 1 < len(records)]
    if not chosen:
        return "no decode steps"
    intervals = [records[i + 1].start - records[i].start for i in chosen]
    gpu = [records[i].gpu_ms for i in chosen if records[i].gpu_ms is not None]
    return statistics.median(intervals), statistics.median(gpu) if gpu else None


def time_mode(
    engine: Engine, runner: object, mode: str, batch: int, context: int, warmup: int, iters: int
) -> tuple[float | None, float | None, str]:
    """(median seconds per decode step, median device ms of a pipelined step, why the point could
    not run) in ``mode``: graph and pipelined replay ``runner``'s CUDA graphs, eager runs none."""
    engine.graph_runner = runner if mode in ("graph", "pipelined") else None
    if mode == "pipelined":
        timed = time_pipelined(engine, batch, context, warmup, iters)
        return (None, None, timed) if isinstance(timed, str) else (timed[0], timed[1], "")
    return time_decode(engine, batch, context, warmup, iters), None, "no KV room"


def parse_timing_args(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """Adds --warmup, --iters and --out, parses, and returns the args with the comma-separated
    ``--modes`` of ``time_mode`` (a usage error names bad ones)."""
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    setup_logging()
    modes = args.modes.split(",")
    unknown = set(modes) - {"graph", "eager", "pipelined"}
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose among graph, eager, pipelined")
    return args, modes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="directory with a config.json (weights are random)")
    parser.add_argument("--batch-sizes", type=ints, default=ints("1,2,4,8,16,32,64,128,256"))
    parser.add_argument("--contexts", type=ints, default=ints("512,4096"))
    parser.add_argument(
        "--modes", default="graph,eager",
        help="graph (CUDA graphs), eager, pipelined (a Scheduler with overlap scheduling, graphs when captured)",
    )
    parser.add_argument("--decode-attention", default="auto", help="auto | flashinfer | xqa | triton (the flashinfer backend's decode kernel)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8_e4m3")
    args, modes = parse_timing_args(parser)

    bandwidth = copy_bandwidth() if torch.cuda.is_available() else None  # no floors without CUDA
    graphs = "graph" in modes or "pipelined" in modes
    engine = make_engine(
        args.model, cuda_graph_max_bs=max(args.batch_sizes) if graphs else 0,
        decode_attention=args.decode_attention, kv_cache_dtype=args.kv_cache_dtype,
    )
    fill_kv_randomly(engine)
    runner = engine.graph_runner
    per_token_kv = kv_bytes_per_token(engine)
    rows = []
    for context in args.contexts:
        for batch in args.batch_sizes:
            weight_bytes = weight_bytes_per_decode_step(engine, batch)
            # Attention reads each sequence's cache including the token being decoded.
            kv_bytes = batch * (context + args.warmup + args.iters // 2 + 1) * per_token_kv
            floor = None if bandwidth is None else (weight_bytes + kv_bytes) / bandwidth
            row = {"context": context, "batch": batch, "floor_ms": None if floor is None else floor * 1e3}
            for mode in modes:
                seconds, gpu_ms, skipped = time_mode(engine, runner, mode, batch, context, args.warmup, args.iters)
                if seconds is None:
                    row[f"{mode}_ms"], row[f"{mode}_x_floor"] = skipped, ""
                else:
                    row[f"{mode}_ms"] = seconds * 1e3
                    row[f"{mode}_x_floor"] = None if floor is None else seconds / floor
                if mode == "pipelined":
                    row["pipelined_gpu_ms"] = gpu_ms
            rows.append(row)
            print(row, flush=True)
    engine.graph_runner = runner

    columns = ["context", "batch", "floor_ms"]
    for mode in modes:
        columns += [f"{mode}_ms", f"{mode}_x_floor"] + (["pipelined_gpu_ms"] if mode == "pipelined" else [])
    bw = "n/a (no CUDA)" if bandwidth is None else f"{bandwidth / 1e12:.2f} TB/s"
    print(f"\nDecode step vs memory floor; copy bandwidth {bw}; model {args.model}; "
          f"decode attention {args.decode_attention}, KV {args.kv_cache_dtype}")
    print_table([{k: "n/a" if v is None else v for k, v in row.items()} for row in rows], columns)
    write_json(
        args.out,
        {
            "benchmark": "decode_latency",
            "model": args.model,
            "copy_bandwidth_Bps": bandwidth,
            "kv_pages": engine.num_pages - 1,
            "page_size": engine.page_size,
            "attention": type(engine.attention).__name__,
            "decode_attention": args.decode_attention,
            "kv_cache_dtype": args.kv_cache_dtype,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
