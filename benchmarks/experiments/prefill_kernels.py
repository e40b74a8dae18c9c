"""One prompt's prefill step (random weights) timed, then its CUDA kernels from torch's profiler, summed by
name: where a prefill step's time goes. Self-contained (no benchmarks/common import), so the same file runs
against an older checkout of tpserve to find which kernels a regression is in:

    python benchmarks/experiments/prefill_kernels.py --model tests/data/configs/Qwen3-30B-A3B --tokens 8192
    PYTHONPATH=old/python python benchmarks/experiments/prefill_kernels.py --model ... --label old
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict

import torch

try:
    from tpserve.engine_config import EngineConfig
except ImportError:  # checkouts before the engine's settings left tpserve.config
    from tpserve.config import EngineConfig
from tpserve.engine.engine import Engine
from tpserve.forward import SequenceInput


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="directory with a config.json (weights are random)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seqs", type=int, default=1, help="split the tokens over this many prompts")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--cpu-profile", action="store_true",
                        help="also the host's side: the torch ops and CUDA API calls by self CPU time (syncs show here)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    config = EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", cuda_graph_max_bs=0,
                          max_total_tokens=args.tokens + 1024 * args.seqs)
    engine = Engine(config)
    rng = random.Random(0)
    each = args.tokens // args.seqs
    page = engine.page_size
    seqs = []
    next_page = 1  # page 0 is the padding page
    for _ in range(args.seqs):
        count = -(-each // page)
        seqs.append(SequenceInput([rng.randrange(min(10000, engine.model_config.vocab_size)) for _ in range(each)], 0,
                                  list(range(next_page, next_page + count))))
        next_page += count

    for _ in range(2):
        engine.forward(seqs)
    sync()
    start = time.perf_counter()
    for _ in range(args.iters):
        engine.forward(seqs)
    sync()
    step_ms = (time.perf_counter() - start) / args.iters * 1e3

    activities = [torch.profiler.ProfilerActivity.CUDA]
    if args.cpu_profile:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            engine.forward(seqs)
        sync()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total / 3 / 1e3  # ms per step
            counts[event.name] += 1
    kernel_ms = sum(totals.values())
    print(f"{args.label}: {args.tokens} tokens in {args.seqs} prompts, step {step_ms:.2f} ms, kernels {kernel_ms:.2f} ms")
    print(f"{'ms/step':>9} {'share':>6} {'calls':>6}  kernel")
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    for name, ms in rows[:args.top]:
        print(f"{ms:9.3f} {ms / kernel_ms:6.1%} {counts[name] // 3:6d}  {name[:110]}")
    if args.cpu_profile:
        host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        print(f"host, per step: {'self ms':>8} {'calls':>6}  op")
        for e in host[:args.top]:
            print(f"{'':16}{e.self_cpu_time_total / 3 / 1e3:8.3f} {e.count // 3:6d}  {e.key[:100]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"label": args.label, "tokens": args.tokens, "seqs": args.seqs, "step_ms": step_ms,
                       "kernels_ms": dict(rows)}, f, indent=1)


if __name__ == "__main__":
    main()
