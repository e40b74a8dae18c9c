"""Tile sizes of the grouped MoE GEMM (``kernels.moe._grouped_gemm_kernel``) at prefill sizes.

Qwen3-30B-A3B's experts (128 experts, hidden 2048, expert intermediate 768 at TP 1, 384 at TP 2),
rows = tokens x top-k routed uniformly at random. For each tile config: both GEMMs of the layer
(gate_up: N = 2I, K = H from the token rows; down: N = H, K = I from the rows), graph-timed, as
TFLOP/s of the rows' real work; each config's output checked against the current default's.
Prints one table per shape and the best config per row count.

    python benchmarks/experiments/moe_tiles.py --out $OUT/moe_tiles.json
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
if importlib.util.find_spec("tpserve") is None:
    sys.path.insert(0, os.path.join(_ROOT, "python"))

import torch
from common import print_table, time_cuda, write_json
from tpserve.kernels.moe import _grouped_gemm_kernel, align_by_expert

EXPERTS, HIDDEN, TOP_K = 128, 2048, 8
DEFAULT = (64, 64, 64, 4, 3)  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: the kernel's launch at > 512 rows


def launch(a, w, out, sorted_rows, block_expert, padded_len, rows, rows_per_token, config) -> None:
    block_m, block_n, block_k, warps, stages = config
    n, k = w.shape[1], w.shape[2]
    grid = (sorted_rows.numel() // block_m, triton_cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, out, sorted_rows, block_expert, padded_len,
        rows, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROWS_PER_TOKEN=rows_per_token, SCALE=False, IEEE=False,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def graph_time(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, warmup=3, iters=20)


def run_shape(tokens: int, intermediate: int, configs: list[tuple]) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    gate_up = (torch.randn(EXPERTS, 2 * intermediate, HIDDEN, device="cuda", generator=gen) * 0.02).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, intermediate, device="cuda", generator=gen) * 0.02).bfloat16()
    hidden = torch.randn(tokens * TOP_K, intermediate, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices  # int64, as the router
    rows = tokens * TOP_K
    flops = 2 * rows * (2 * intermediate * HIDDEN + HIDDEN * intermediate)
    reference = None
    out_rows = []
    for config in [DEFAULT, *[c for c in configs if c != DEFAULT]]:
        sorted_rows, block_expert, padded_len = align_by_expert(ids, EXPERTS, config[0])
        up_out = torch.empty(rows, 2 * intermediate, device="cuda", dtype=torch.bfloat16)
        down_out = torch.empty(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)

        def both(sorted_rows=sorted_rows, block_expert=block_expert, padded_len=padded_len, config=config):
            launch(x, gate_up, up_out, sorted_rows, block_expert, padded_len, rows, TOP_K, config)
            launch(hidden, down, down_out, sorted_rows, block_expert, padded_len, rows, 1, config)

        try:
            seconds = graph_time(both)
        except Exception as e:  # a config past the shared memory: reported, the others still run
            out_rows.append({"tokens": tokens, "I": intermediate, "config": str(config), "error": type(e).__name__})
            continue
        result = torch.cat([up_out.float().flatten(), down_out.float().flatten()])
        if reference is None:
            reference = result
        err = float((result - reference).norm() / reference.norm())
        out_rows.append({"tokens": tokens, "I": intermediate, "config": str(config), "us": seconds * 1e6,
                         "tflops": flops / seconds / 1e12, "err_vs_default": err})
    return out_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="512,2048,8192", help="tokens per step (rows = tokens x 8)")
    parser.add_argument("--intermediates", default="768,384", help="expert intermediate size per rank (TP 1, TP 2)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    configs = [c for c in itertools.product((64, 128), (64, 128), (64, 128), (4, 8), (3, 4))
               if not (c[0] == 128 and c[1] == 128 and c[3] == 4)]  # 128x128 needs 8 warps
    results, best = [], []
    for tokens, intermediate in itertools.product(map(int, args.tokens.split(",")), map(int, args.intermediates.split(","))):
        rows = run_shape(tokens, intermediate, configs)
        results += rows
        ok = [r for r in rows if "us" in r and r["err_vs_default"] < 1e-2]
        ok.sort(key=lambda r: r["us"])
        print(f"\ntokens {tokens}, I {intermediate}: fastest 6 of {len(rows)} configs (BLOCK_M, N, K, warps, stages)")
        print_table(ok[:6], ["config", "us", "tflops", "err_vs_default"])
        default = next(r for r in rows if r["config"] == str(DEFAULT))
        best.append({"tokens": tokens, "I": intermediate, "best": ok[0]["config"], "best_us": ok[0]["us"],
                     "default_us": default["us"], "speedup": default["us"] / ok[0]["us"],
                     "best_tflops": ok[0]["tflops"]})
    print("\nBest tile per shape against the default (64, 64, 64, 4 warps, 3 stages)")
    print_table(best, list(best[0]))
    write_json(args.out, {"benchmark": "moe_tiles", "rows": results, "best": best})


if __name__ == "__main__":
    main()
