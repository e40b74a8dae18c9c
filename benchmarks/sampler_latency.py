"""Sampler time per step: the fused Triton kernel against the torch path, on random logits.

Rows have temperature 0.6 and no top-k/top-p/min-p (the fused kernel's case); each size is
timed with CUDA events (median), including the output tokens' allocation, not the host copy.

    python benchmarks/sampler_latency.py --batch-sizes 1,64,256 --vocab 151936
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from common import print_table, time_cuda, write_json
from tpserve.engine.sampler import Sampler, SamplingBatch
from tpserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sampler = Sampler()
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        logits = torch.randn(batch, args.vocab, device="cuda").mul_(3).to(torch.bfloat16)
        sampling = SamplingBatch.build(
            [SamplingParams(temperature=0.6)] * batch, list(range(batch)), [1] * batch, args.vocab, "cuda"
        )
        fused_ms = time_cuda(partial(sampler, logits, sampling), warmup=3, iters=20) * 1e3
        torch_ms = time_cuda(partial(sampler.sample_torch, logits, sampling), warmup=3, iters=20) * 1e3
        agree = (sampler(logits, sampling) == sampler.sample_torch(logits, sampling)).float().mean().item()
        rows.append({"batch": batch, "fused_ms": fused_ms, "torch_ms": torch_ms, "speedup": torch_ms / fused_ms, "agree": agree})
        print(rows[-1], flush=True)
    print(f"\nSampler, vocab {args.vocab}, temperature 0.6, bf16 logits")
    print_table(rows, ["batch", "fused_ms", "torch_ms", "speedup", "agree"])
    write_json(args.out, {"benchmark": "sampler_latency", "vocab": args.vocab, "rows": rows})


if __name__ == "__main__":
    main()
