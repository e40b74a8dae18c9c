"""Whole decode steps with each decode attention kernel (``--decode-attention``), the engines held in
one process and timed in turn, round after round.

Every engine gets the same random weights and KV cache, so one graph step's logits are compared with
the first kernel's first (max difference over the logits' largest magnitude, and whether the argmax
agrees). Then each (batch, context) point is timed: the synchronous step (forward + sampling + host
sync), the pipelined one (the step interval under overlap scheduling) and a pipelined step's GPU time
(an interval longer than that is the host's). Variants: ``triton:nopdl``, the same kernel with
tpserve's Triton kernels launched without programmatic dependent launch; ``:finorm``, FlashInfer's
add + RMSNorm instead of tpserve's; ``triton:chunk=16:max_splits=64``, the Triton kernel with other
settings (``TPSERVE_TRITON_DECODE``).

    python benchmarks/experiments/triton_attention_engine.py --model tests/data/configs/Qwen3-8B \\
        --kernels flashinfer,triton --batch-sizes 1,8 --contexts 512,4096 --out out/triton_attention_engine.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from common import environment, fill_kv_randomly, make_engine, print_table, setup_logging, write_json  # noqa: E402
from decode_latency import ints, time_decode, time_pipelined  # noqa: E402
from tpserve.forward import SequenceInput  # noqa: E402
from tpserve.kernels.pdl import TRITON_PDL_ENV  # noqa: E402
from tpserve.kernels.add_rmsnorm import ENV as ADD_RMSNORM_ENV  # noqa: E402
from tpserve.kvcache.pool import PageAllocator  # noqa: E402
from tpserve.attention.triton_decode import CONFIG_ENV, CONFIG_RANGES, config_from_env  # noqa: E402


# Engine variants: the environment each is built with.
VARIANTS = {"nopdl": {TRITON_PDL_ENV: "0"}, "finorm": {ADD_RMSNORM_ENV: "0"}}


def step_logits(engine, batch: int, context: int) -> torch.Tensor:
    """One graph decode step's logits over the same pages in every engine (same random KV)."""
    allocator = PageAllocator(engine.num_pages)
    seqs = [SequenceInput([7 + i], context, allocator.allocate(-(-(context + 1) // engine.page_size)))
            for i in range(batch)]
    return engine.forward(seqs).float().clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--kernels", default="flashinfer,triton",
                        help="--decode-attention values, the first the base, each maybe with variants that set the "
                             "environment its engine is built (and its graphs captured) with: "
                             + ", ".join(f"':{name}' {env}" for name, env in VARIANTS.items())
                             + f", and the Triton kernel's settings (':chunk=16:max_splits=64': {CONFIG_ENV})")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    setup_logging()
    kernels, batches, contexts = args.kernels.split(","), ints(args.batch_sizes), ints(args.contexts)
    tokens = max(batches) * (max(contexts) + args.warmup + args.iters + 64) + 4096
    engines = {}
    for kernel in kernels:
        name, *variants = kernel.split(":")
        settings = [v for v in variants if "=" in v]  # the Triton kernel's own, e.g. triton:chunk=16:max_splits=64
        named = [v for v in variants if "=" not in v]
        if not set(named) <= set(VARIANTS):
            parser.error(f"unknown variant in {kernel!r}: the variants are {', '.join(VARIANTS)} and NAME=VALUE "
                         f"settings of {CONFIG_ENV} ({', '.join(CONFIG_RANGES)})")
        env = {key: value for variant in named for key, value in VARIANTS[variant].items()}
        if settings:
            env[CONFIG_ENV] = " ".join(settings)
            config_from_env(env[CONFIG_ENV])  # a bad setting fails here, before any engine is built
        with environment(env):  # every engine replays the graphs its own setting captured
            engines[kernel] = make_engine(args.model, max_total_tokens=tokens, cuda_graph_max_bs=max(batches),
                                          decode_attention=name)
        fill_kv_randomly(engines[kernel])
        print(kernel, engines[kernel].attention.describe(), flush=True)
    logits = {name: step_logits(engine, batches[0], contexts[0]) for name, engine in engines.items()}
    base = logits[kernels[0]]
    agreement = {name: {"logit_diff": float((lg - base).abs().max() / base.abs().max()),
                        "same_argmax": bool(torch.equal(lg.argmax(-1), base.argmax(-1)))}
                 for name, lg in logits.items()}
    print("one decode step against", kernels[0], agreement, flush=True)
    rows = []
    for batch in batches:
        for context in contexts:
            sync: dict[str, list[float]] = {name: [] for name in engines}
            piped: dict[str, list[float]] = {name: [] for name in engines}
            piped_gpu: dict[str, list[float]] = {name: [] for name in engines}
            for _ in range(args.rounds):
                for name, engine in engines.items():
                    step = time_decode(engine, batch, context, args.warmup, args.iters)
                    sync[name].append(float("nan") if step is None else step * 1e3)  # None: the cache is too small
                    timed = time_pipelined(engine, batch, context, args.warmup, args.iters)
                    piped[name].append(float("nan") if isinstance(timed, str) else timed[0] * 1e3)
                    # The GPU's time per pipelined step: an interval above it is the host's.
                    piped_gpu[name].append(float("nan") if isinstance(timed, str) or timed[1] is None else timed[1])
            for name in engines:
                rows.append({"kernel": name, "batch": batch, "context": context,
                             "step_ms": round(statistics.median(sync[name]), 3),
                             "pipelined_ms": round(statistics.median(piped[name]), 3),
                             "pipelined_gpu_ms": round(statistics.median(piped_gpu[name]), 3),
                             "piped_over_base": round(statistics.median(
                                 a / b for a, b in zip(piped[name], piped[kernels[0]])), 4)})
                print(rows[-1], flush=True)
    print(f"\n{args.model}: decode kernels, {args.rounds} alternating rounds")
    print_table(rows, list(rows[0]))
    write_json(args.out, {"benchmark": "triton_attention_engine", "model": args.model, "args": vars(args),
                          "agreement": agreement, "rows": rows})


if __name__ == "__main__":
    main()
