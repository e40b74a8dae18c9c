"""Whole decode steps with triton_decode_attention.py's split-KV kernels in place of FlashInfer's
decode wrapper, against the unchanged engine, both held in one process and timed in turn.

The engine is not changed: while the patched engine is built (its CUDA graphs captured),
``FlashInferMetadata.attend`` runs the Triton kernels on the decode wrapper's own page-table
buffers (``_paged_kv_indptr_buf`` ...) for batches up to ``--max-batch``; prefill and larger
batches keep FlashInfer. Both engines get the same random weights and KV cache, so one decode
step's logits are compared first (max difference relative to the logits' largest magnitude).

    python benchmarks/experiments/triton_attention_engine.py --model tests/data/configs/Qwen3-30B-A3B \
        --splits 8 --rounds 3 --out out/triton_attention_engine.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from common import fill_kv_randomly, make_engine, print_table, setup_logging, write_json  # noqa: E402
from decode_latency import time_decode, time_pipelined  # noqa: E402
from triton_decode_attention import decode_attention  # noqa: E402
from tpserve.attention.flashinfer_backend import FlashInferMetadata  # noqa: E402
from tpserve.engine.sampler import SamplingBatch  # noqa: E402
from tpserve.forward import SequenceInput  # noqa: E402
from tpserve.kvcache.pool import PageAllocator  # noqa: E402
from tpserve.sampling_params import SamplingParams  # noqa: E402


def triton_attend(splits: int, block_t: int, one_kernel: bool, max_batch: int):
    original = FlashInferMetadata.attend

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        wrapper = self.wrapper
        if type(wrapper).__name__ != "BatchDecodeWithPagedKVCacheWrapper" or q.shape[0] > max_batch:
            return original(self, q, k_cache, v_cache)
        scale = getattr(wrapper, "_sm_scale", None) or 1 / math.sqrt(q.shape[-1])
        return decode_attention(q.contiguous(), k_cache, v_cache, wrapper._paged_kv_indptr_buf,
                                wrapper._paged_kv_indices_buf, wrapper._paged_kv_last_page_len_buf, scale,
                                splits, block_t, one_kernel)

    return original, attend


def build(model: str, context: int, batch: int, warmup: int, iters: int):
    engine = make_engine(model, max_total_tokens=(batch + 2) * (context + warmup + iters + 64),
                         cuda_graph_max_bs=batch, decode_attention="flashinfer")
    fill_kv_randomly(engine)
    return engine


def step_logits(engine, batch: int, context: int) -> torch.Tensor:
    """One graph decode step's logits over the same pages in both engines (same random KV)."""
    allocator = PageAllocator(engine.num_pages)
    seqs = [SequenceInput([7 + i], context, allocator.allocate(-(-(context + 1) // engine.page_size)))
            for i in range(batch)]
    return engine.forward(seqs).float().clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--splits", type=int, default=8)
    parser.add_argument("--block-t", type=int, default=32)
    parser.add_argument("--one-kernel", action="store_true", help="merge in the last split program (atomic counter)")
    parser.add_argument("--max-batch", type=int, default=8, help="decode batches up to this take the Triton kernels")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    setup_logging()
    original, patched = triton_attend(args.splits, args.block_t, args.one_kernel, args.max_batch)
    FlashInferMetadata.attend = patched
    try:
        engines = {"triton": build(args.model, args.context, args.batch, args.warmup, args.iters)}
    finally:
        FlashInferMetadata.attend = original
    engines["flashinfer"] = build(args.model, args.context, args.batch, args.warmup, args.iters)
    logits = {name: step_logits(engine, args.batch, args.context) for name, engine in engines.items()}
    diff = float((logits["triton"] - logits["flashinfer"]).abs().max() / logits["flashinfer"].abs().max())
    same_argmax = bool(torch.equal(logits["triton"].argmax(-1), logits["flashinfer"].argmax(-1)))
    print(f"one decode step: max logit difference {diff:.2e} of the largest logit; same argmax: {same_argmax}")
    sync: dict[str, list[float]] = {name: [] for name in engines}
    piped: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            sync[name].append(time_decode(engine, args.batch, args.context, args.warmup, args.iters) * 1e3)
            timed = time_pipelined(engine, args.batch, args.context, args.warmup, args.iters)
            piped[name].append(float("nan") if isinstance(timed, str) else timed[0] * 1e3)
    rows = [{"variant": name, "batch": args.batch, "context": args.context, "step_ms": statistics.median(sync[name]),
             "pipelined_ms": statistics.median(piped[name]),
             "over_flashinfer": statistics.median(a / b for a, b in zip(sync[name], sync["flashinfer"]))}
            for name in engines]
    print(f"\n{args.model}: splits {args.splits}, one kernel {args.one_kernel}")
    print_table(rows, list(rows[0]))
    write_json(args.out, {"benchmark": "triton_attention_engine", "model": args.model, "args": vars(args),
                          "logit_diff": diff, "same_argmax": same_argmax, "rows": rows})


if __name__ == "__main__":
    main()
