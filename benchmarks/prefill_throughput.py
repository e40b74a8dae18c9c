"""Prefill throughput and MFU of one prompt at a time, against a bf16 matmul peak measured in
this run.

    python benchmarks/prefill_throughput.py --model ../shared/models/configs/Qwen3-8B \
        --lengths 1024,2048,4096,8192,16384 --out out/prefill_8b.json
"""

from __future__ import annotations

import argparse
import random
from functools import partial

from common import (
    make_engine,
    matmul_peak,
    prefill_flops,
    print_table,
    setup_logging,
    time_cuda,
    write_json,
)
from tpserve.forward import SequenceInput
from tpserve.kvcache.pool import PageAllocator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="directory with a config.json (weights are random)")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    setup_logging()
    lengths = [int(x) for x in args.lengths.split(",")]

    peak = matmul_peak()
    engine = make_engine(args.model, cuda_graph_max_bs=0, max_total_tokens=max(lengths) + 1024)
    allocator = PageAllocator(engine.num_pages)
    rng = random.Random(0)
    rows = []
    for length in lengths:
        pages = allocator.allocate(-(-length // engine.page_size))
        seq = SequenceInput([rng.randrange(10000) for _ in range(length)], 0, pages)
        seconds = time_cuda(partial(engine.forward, [seq]), warmup=2, iters=args.iters)
        allocator.free(pages)
        flops = prefill_flops(engine, length)
        rows.append(
            {
                "tokens": length,
                "ms": seconds * 1e3,
                "tok_per_s": length / seconds,
                "TFLOPs": flops / seconds / 1e12,
                "MFU": flops / seconds / peak,
            }
        )
        print(rows[-1], flush=True)

    print(f"\nPrefill of one prompt; bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; model {args.model}")
    print_table(rows, ["tokens", "ms", "tok_per_s", "TFLOPs", "MFU"])
    write_json(
        args.out,
        {
            "benchmark": "prefill_throughput",
            "model": args.model,
            "matmul_peak_flops": peak,
            "attention": type(engine.attention).__name__,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
