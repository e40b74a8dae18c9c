"""The MoE sort by expert (``kernels.moe.align_by_expert``) at decode and prefill sizes: the kernels of many programs
against what ran before session 32, the one-program kernel (kept below as the baseline) up to 4,096 rows and torch's
sort above.

Session 5's profile of a Qwen3-30B-A3B decode step at batch 64 put the one-program sort at 37 us a MoE layer,
9% of the step's GPU time; torch's sort is a dozen kernels a layer in a prefill step. Each variant is graph-timed
alone on Qwen3-30B-A3B's routing (128 experts, top 8, uniform), checked equal to torch's sort; then the whole
expert computation (``grouped_experts``: the sort, both GEMMs, SiLU-and-mul, the sum over k) with each sort.
Prints a table per part.

    python benchmarks/experiments/moe_align.py --out $OUT/moe_align.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
if importlib.util.find_spec("tpserve") is None:
    sys.path.insert(0, os.path.join(_ROOT, "python"))

import torch
import triton
import triton.language as tl
from common import print_table, write_json
from tpserve.kernels import moe
from tpserve.kernels.moe import aligned_capacity, align_by_expert, align_by_expert_torch, grouped_experts, tiles_for
from tpserve.plan.calibrate import time_in_graph

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 128, 2048, 768, 8
ITERS = 50  # graph replays a timing, the median taken


@triton.jit
def _one_program_align_kernel(
    ids_ptr, sorted_rows_ptr, block_expert_ptr, padded_len_ptr, rows, capacity, num_experts,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    """The sort up to session 31 (kernels/moe.py): one program counts, pads, labels and places, CHUNK rows a step."""
    experts = tl.arange(0, E_PAD)
    real = experts < num_experts
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, rows, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < rows, other=E_PAD).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    counts = tl.where(real, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(padded_len_ptr, tl.sum(padded, axis=0))
    for start in range(0, capacity, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_rows_ptr + offs, tl.full((CHUNK,), 0, tl.int32) + rows, mask=offs < capacity)
    num_blocks = capacity // BLOCK_M
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        before = (ends[None, :] <= blocks[:, None] * BLOCK_M) & real[None, :]
        expert = tl.minimum(tl.sum(before.to(tl.int32), axis=1), num_experts - 1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)
    tl.debug_barrier()
    cursor = ends - padded
    for start in range(0, rows, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < rows, other=E_PAD).to(tl.int32)
        onehot = ids[:, None] == experts[None, :]
        base = tl.sum(tl.where(onehot, cursor[None, :], 0), axis=1)
        earlier = (ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_rows_ptr + base + rank, offs, mask=(offs < rows) & (ids < num_experts))
        cursor += tl.sum(onehot.to(tl.int32), axis=0)


def sort_outputs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[int, tuple[torch.Tensor, ...]]:
    """The sort's capacity and its outputs (sorted rows, block experts, padded length), as ``align_by_expert``'s."""
    capacity = aligned_capacity(ids.numel(), num_experts, block_m)
    return capacity, tuple(torch.empty(n, dtype=torch.int32, device=ids.device)
                           for n in (capacity, capacity // block_m, 1))


def one_program_align(ids: torch.Tensor, num_experts: int, block_m: int):
    capacity, out = sort_outputs(ids, num_experts, block_m)
    _one_program_align_kernel[(1,)](ids.contiguous(), *out, ids.numel(), capacity, num_experts, BLOCK_M=block_m,
                                    E_PAD=triton.next_power_of_2(num_experts + 1), CHUNK=64, num_warps=4)
    return out


def many_program_align(chunk: int, warps: int, hist_chunk: int = moe.ALIGN_HIST_CHUNK):
    """``align_by_expert``'s one-kernel form at another chunk, warp count and histogram step."""
    def align(ids: torch.Tensor, num_experts: int, block_m: int):
        capacity, out = sort_outputs(ids, num_experts, block_m)
        moe._align_kernel[(triton.cdiv(capacity, chunk),)](
            ids.contiguous(), *out, ids.numel(), capacity, num_experts, out[2], BLOCK_M=block_m,
            E_PAD=triton.next_power_of_2(num_experts + 1), CHUNK=chunk, HIST_CHUNK=hist_chunk, COUNTED=False,
            COUNT_CHUNK=moe.ALIGN_COUNT_CHUNK, num_warps=warps)
        return out
    return align


def counted_align(count_chunk: int):
    """``align_by_expert``'s two-kernel form (rows counted per chunk first) at any row count."""
    return lambda ids, num_experts, block_m: align_by_expert(ids, num_experts, block_m, one_kernel_max_rows=0,
                                                            count_chunk=count_chunk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="9,16,32,64,128,256,512,1024,8192",
                        help="tokens per step (rows = tokens x 8): decode batches, then prefill chunks")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sorts = {"before": None, "default": align_by_expert, "torch": align_by_expert_torch}
    sorts |= {f"one kernel, chunk {c} w{w}": many_program_align(c, w) for c in (32, 64, 128) for w in (4, 8)
              if (c, w) != (64, 4)}
    sorts |= {f"one kernel, histogram step {h}": many_program_align(64, 4, h) for h in (256, 1024)}
    sorts |= {f"two kernels, count chunk {c}": counted_align(c) for c in (1024, 2048, 4096)}
    alone, layer = [], []
    for tokens in map(int, args.tokens.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices
        block_m = tiles_for(ids.numel()).block_m
        want = align_by_expert_torch(ids, EXPERTS, block_m)
        # before session 32: one program up to 4,096 rows, torch's sort above
        sorts["before"] = one_program_align if ids.numel() <= 4096 else align_by_expert_torch
        for name, sort in sorts.items():
            got = sort(ids, EXPERTS, block_m)
            equal = all(torch.equal(g.long(), w.long()) for g, w in zip(got, want))
            alone.append({"tokens": tokens, "rows": ids.numel(), "block_m": block_m, "sort": name, "equal": equal,
                          "us": time_in_graph(lambda sort=sort: sort(ids, EXPERTS, block_m), ITERS, repeat=20) * 1e6})
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
        gate_up = (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, device="cuda", generator=gen) * 0.02).bfloat16()
        down = (torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, device="cuda", generator=gen) * 0.02).bfloat16()
        weights = torch.rand(tokens, TOP_K, device="cuda", generator=gen)
        outputs = {}
        for name in ("before", "default"):
            moe.align_by_expert = sorts[name]  # grouped_experts looks the sort up in its module
            try:
                seconds = time_in_graph(lambda name=name: outputs.__setitem__(
                    name, grouped_experts(x, gate_up, down, weights, ids)), ITERS, repeat=1)
            finally:
                moe.align_by_expert = align_by_expert
            layer.append({"tokens": tokens, "sort": name, "us": seconds * 1e6})
        same = torch.equal(outputs["default"], outputs["before"])
        layer[-1]["same_output"] = layer[-2]["same_output"] = same
        layer[-1]["speedup"] = layer[-2]["us"] / layer[-1]["us"]
        del gate_up, down
    summary = []
    for tokens in dict.fromkeys(r["tokens"] for r in alone):
        runs = {r["sort"]: r for r in alone if r["tokens"] == tokens}
        best = min((r for r in runs.values() if r["equal"]), key=lambda r: r["us"])
        summary.append({"tokens": tokens, "rows": best["rows"], "before_us": runs["before"]["us"],
                        "default_us": runs["default"]["us"], "speedup": runs["before"]["us"] / runs["default"]["us"],
                        "all_equal": all(r["equal"] for r in runs.values()), "fastest": best["sort"],
                        "fastest_us": best["us"]})
    print("\nThe sort alone (graph replays; every variant in the JSON)")
    print_table(summary, list(summary[0]))
    print("\nThe experts (grouped_experts) with each sort")
    print_table(layer, ["tokens", "sort", "us", "speedup", "same_output"])
    write_json(args.out, {"benchmark": "moe_align", "alone": alone, "layer": layer})


if __name__ == "__main__":
    main()
