"""Decode step time against the memory floor.

For each context length and batch size, ``batch`` sequences sit at ``context`` cached tokens and
decode greedily for a few steps through ``Engine.step`` (forward, sampling and the host sync, the
way the scheduler calls it). The floor is the bytes one step must read (every weight once plus
every sequence's KV) over the device-copy bandwidth measured in this run.

    python benchmarks/decode_latency.py --model ../shared/models/configs/Qwen3-8B \
        --batch-sizes 1,64 --contexts 512 --modes graph,eager --out out/decode_8b.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import (
    copy_bandwidth,
    fill_kv_randomly,
    kv_bytes_per_token,
    make_engine,
    print_table,
    setup_logging,
    weight_bytes_per_decode_step,
    write_json,
)
from tpserve.engine.batch import SequenceInput
from tpserve.engine.engine import Engine
from tpserve.engine.sampler import SamplingBatch
from tpserve.kvcache.pool import PageAllocator
from tpserve.sampling_params import SamplingParams


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
        tokens = engine.step(seqs, sampling)
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="directory with a config.json (weights are random)")
    parser.add_argument("--batch-sizes", type=ints, default=ints("1,2,4,8,16,32,64,128,256"))
    parser.add_argument("--contexts", type=ints, default=ints("512,4096"))
    parser.add_argument("--modes", default="graph,eager", help="graph (CUDA graphs) and/or eager")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    setup_logging()
    modes = args.modes.split(",")

    bandwidth = copy_bandwidth()
    engine = make_engine(args.model, cuda_graph_max_bs=max(args.batch_sizes) if "graph" in modes else 0)
    fill_kv_randomly(engine)
    runner = engine.graph_runner
    per_token_kv = kv_bytes_per_token(engine)
    rows = []
    for context in args.contexts:
        for batch in args.batch_sizes:
            weight_bytes = weight_bytes_per_decode_step(engine, batch)
            # Attention reads each sequence's cache including the token being decoded.
            kv_bytes = batch * (context + args.warmup + args.iters // 2 + 1) * per_token_kv
            floor = (weight_bytes + kv_bytes) / bandwidth
            row = {"context": context, "batch": batch, "floor_ms": floor * 1e3}
            for mode in modes:
                engine.graph_runner = runner if mode == "graph" else None
                seconds = time_decode(engine, batch, context, args.warmup, args.iters)
                row[f"{mode}_ms"] = "no KV room" if seconds is None else seconds * 1e3
                row[f"{mode}_x_floor"] = "" if seconds is None else seconds / floor
            rows.append(row)
            print(row, flush=True)
    engine.graph_runner = runner

    columns = ["context", "batch", "floor_ms"] + [f"{m}_{s}" for m in modes for s in ("ms", "x_floor")]
    print(f"\nDecode step vs memory floor; copy bandwidth {bandwidth / 1e12:.2f} TB/s; model {args.model}")
    print_table(rows, columns)
    write_json(
        args.out,
        {
            "benchmark": "decode_latency",
            "model": args.model,
            "copy_bandwidth_Bps": bandwidth,
            "kv_pages": engine.num_pages - 1,
            "page_size": engine.page_size,
            "attention": type(engine.attention).__name__,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
