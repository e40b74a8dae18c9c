"""Sampler time per step: the fused Triton kernel against the torch path, on random logits.

Cases: greedy (the one-launch argmax, ``kernels.sampling.greedy``, against ``torch.argmax``), temperature
0.6 with no filter, temperature 0.6 with top-k 20 + top-p 0.8 and temperature 1.0 with top-p + min-p (the
kernel's bisection variant); each size is timed with CUDA events (median), including the output tokens'
allocation, not the host copy. A call of a few microseconds of GPU work is timed by its host launch there; the
greedy case is also timed as CUDA graph replays of 20 calls (``*_graph_us``: GPU time alone, as in a pipelined
decode step, where the launch overlaps the GPU's work).

    python benchmarks/sampler_latency.py --batch-sizes 1,16,64,256 --vocab 151936
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from common import print_table, time_cuda, write_json
from tpserve.engine.sampler import Sampler, SamplingBatch
from tpserve.plan.calibrate import time_in_graph
from tpserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sampler = Sampler()
    rows = []
    cases = {"greedy": SamplingParams(temperature=0.0), "t0.6": SamplingParams(temperature=0.6), "t0.6 k20 p0.8": SamplingParams(temperature=0.6, top_k=20, top_p=0.8),
             "t1.0 p0.95 minp0.02": SamplingParams(temperature=1.0, top_p=0.95, min_p=0.02)}
    for (case, params), batch in [(c, int(b)) for c in cases.items() for b in args.batch_sizes.split(",")]:
        logits = torch.randn(batch, args.vocab, device="cuda").mul_(3).to(torch.bfloat16)
        sampling = SamplingBatch.build([params] * batch, list(range(batch)), [1] * batch, args.vocab, "cuda")
        fused_ms = time_cuda(partial(sampler, logits, sampling), warmup=3, iters=20) * 1e3
        torch_ms = time_cuda(partial(sampler.sample_torch, logits, sampling), warmup=3, iters=20) * 1e3
        agree = (sampler(logits, sampling) == sampler.sample_torch(logits, sampling)).float().mean().item()
        row = {"case": case, "batch": batch, "fused_ms": fused_ms, "torch_ms": torch_ms, "speedup": torch_ms / fused_ms,
               "agree": agree, "fused_graph_us": None, "torch_graph_us": None}
        if params.temperature == 0.0:
            row["fused_graph_us"] = time_in_graph(partial(sampler, logits, sampling), iters=10, repeat=20) * 1e6
            row["torch_graph_us"] = time_in_graph(partial(torch.argmax, logits, dim=-1), iters=10, repeat=20) * 1e6
        rows.append(row)
        print(rows[-1], flush=True)
    print(f"\nSampler, vocab {args.vocab}, bf16 logits")
    print_table(rows, ["case", "batch", "fused_ms", "torch_ms", "speedup", "agree", "fused_graph_us", "torch_graph_us"])
    write_json(args.out, {"benchmark": "sampler_latency", "vocab": args.vocab, "rows": rows})


if __name__ == "__main__":
    main()
