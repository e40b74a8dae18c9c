"""Decode step time at any TP size, as served (rank processes, CUDA graphs, overlap), against its
floor, for each all-reduce mode.

For a batch of B prompts of C random tokens, greedy, the time of generating T1 and T2 tokens is
measured; the step time is the difference over T2 - T1 (the prefill and start-up cancel). The
floor of a step is each GPU's share of the weights plus the batch's KV cache over the copy
bandwidth measured here, plus 2 all-reduces per layer at the latency --allreduce-json measured
for that message size (the best path of that run), if given.

    python benchmarks/tp_decode_latency.py --model .models/Qwen3-32B --tp-size 2 --batch-sizes 1,64 \
        --all-reduce auto,nccl --out out/tp_decode.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from common import copy_bandwidth, device_name, print_table, setup_logging, write_json
from roofline import model_numbers

from tpserve import LLM, SamplingParams
from tpserve.config import ModelConfig


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def allreduce_seconds(path: str | None, kib: float) -> float | None:
    """The best measured all-reduce latency at the smallest measured size >= kib."""
    if path is None:
        return None
    with open(path) as f:
        rows = json.load(f)["rows"]
    for row in rows:
        if row["size_kib"] >= kib:
            return min(v for k, v in row.items() if k.endswith("_us") and k != "auto_us") / 1e6
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="directory with a config.json (weights are random)")
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--batch-sizes", type=ints, default=[1, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tokens", type=ints, default=[32, 288], help="T1,T2")
    parser.add_argument("--all-reduce", default="auto,nccl", help="modes to compare (comma-separated)")
    parser.add_argument("--allreduce-json", default=None, help="allreduce_latency.py output, for the floor")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    setup_logging()
    bandwidth = copy_bandwidth()
    torch.cuda.empty_cache()
    cfg = ModelConfig.from_pretrained(args.model)
    numbers = model_numbers(args.model)
    t1, t2 = args.tokens
    rows = []
    for mode in args.all_reduce.split(","):
        llm = LLM(args.model, tp_size=args.tp_size, load_format="dummy", dtype="bfloat16", all_reduce=mode)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
        for batch in args.batch_sizes:
            rng = random.Random(batch)
            prompts = [[rng.randrange(10000) for _ in range(args.context)] for _ in range(batch)]
            seconds = {}
            for n in (t1, t2, t1, t2):  # each twice; the faster of the two counts
                params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                seconds[n] = min(seconds.get(n, float("inf")), time.perf_counter() - start)
                llm.flush_cache()
            step = (seconds[t2] - seconds[t1]) / (t2 - t1)
            mean_context = args.context + (t1 + t2) / 2
            weight_bytes = numbers.step_weight_bytes(batch, batch) / args.tp_size
            kv_bytes = batch * mean_context * numbers.kv_per_token / args.tp_size
            ar = allreduce_seconds(args.allreduce_json, batch * cfg.hidden_size * 2 / 1024)
            floor = (weight_bytes + kv_bytes) / bandwidth + (2 * cfg.num_hidden_layers * ar if ar else 0.0)
            rows.append({
                "all_reduce": mode, "batch": batch, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
                "vs_floor": step / floor, "memory_floor_ms": (weight_bytes + kv_bytes) / bandwidth * 1e3,
                "allreduce_us": ar * 1e6 if ar else None,
            })
            print(rows[-1], flush=True)
        llm.close()
    print(f"\nDecode step at TP {args.tp_size} on {device_name()}, {args.model}, context {args.context}+, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print_table(rows, ["all_reduce", "batch", "step_ms", "floor_ms", "vs_floor", "memory_floor_ms", "allreduce_us"])
    write_json(args.out, {"benchmark": "tp_decode_latency", "model": args.model, "tp_size": args.tp_size,
                          "copy_bandwidth_Bps": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
