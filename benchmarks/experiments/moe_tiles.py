"""Tiles of the grouped MoE GEMM (``kernels.moe.grouped_experts``) at prefill and decode sizes.

Qwen3-30B-A3B's experts (128 experts, hidden 2048, expert intermediate 768 at TP 1, 384 at TP 2),
rows = tokens x top-k routed uniformly at random. For each tile (``kernels.moe.Tile``: BLOCK_M, BLOCK_N,
BLOCK_K, warps, stages, GROUP_M, SiLU-and-mul in the first GEMM or not): the whole expert computation (the
sort, both GEMMs, SiLU-and-mul, the sum over k), graph-timed, as TFLOP/s of the rows' work and against its
floor (the touched experts' weights over the copy bandwidth); each tile's output checked against the
default's (``tiles_for``). Prints one table per shape and the best tile per row count. ``--fp8``: the experts in
FP8 with 128 x 128 block scales (Qwen3-30B-A3B-FP8's layout), the FP8 default against the FP8 table's other tiles,
the unquantized experts' (``TILES_BY_ROWS``) and the sweep's.

    python benchmarks/experiments/moe_tiles.py [--sweep decode] [--fp8] --out $OUT/moe_tiles.json
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
from common import print_table, write_json
from tpserve.kernels.moe import FP8_TILES_BY_ROWS, TILES_BY_ROWS, Tile, grouped_experts, tiles_for
from tpserve.plan.calibrate import time_in_graph
from tpserve.quant.fp8 import quantize_experts

EXPERTS, HIDDEN, TOP_K = 128, 2048, 8
COPY_BANDWIDTH = 4.27e12  # bytes/s, an H200's device-to-device copy (benchmarks/roofline.py's)
WHOLE = 1 << 20  # GROUP_M: every row block of a column block first (the launch order before groups)


def label(tile: Tile) -> str:
    group = "all" if tile.group_m >= WHOLE else tile.group_m
    silu = " +silu" if tile.fuse_silu else ""
    return f"{tile.block_m}x{tile.block_n}x{tile.block_k} w{tile.warps} s{tile.stages} g{group}{silu}"


FP8_BLOCK = (128, 128)


def run_shape(tokens: int, intermediate: int, tiles: list[Tile], fp8: bool = False) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    gate_up = (torch.randn(EXPERTS, 2 * intermediate, HIDDEN, device="cuda", generator=gen) * 0.02).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, intermediate, device="cuda", generator=gen) * 0.02).bfloat16()
    scales = None
    if fp8:
        gate_up, down, scales = quantize_experts(gate_up, down, FP8_BLOCK)
    ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices  # int64, as the router
    weights = torch.rand(tokens, TOP_K, device="cuda", generator=gen)
    rows = tokens * TOP_K
    flops = 2 * rows * (2 * intermediate * HIDDEN + HIDDEN * intermediate)
    weight_bytes = ids.unique().numel() * 3 * intermediate * HIDDEN * gate_up.element_size()  # the experts the rows touch
    floor_us = weight_bytes / COPY_BANDWIDTH * 1e6
    default = tiles_for(rows, fp8)
    reference = None
    out_rows = []
    for tile in [default, *[t for t in tiles if t != default]]:
        out = {}

        def run(tile=tile):
            out["y"] = grouped_experts(x, gate_up, down, weights, ids, scales, tile=tile)

        try:
            seconds = time_in_graph(run, 20, repeat=1)
        except Exception as e:  # a tile past the shared memory: reported, the others still run
            out_rows.append({"tokens": tokens, "I": intermediate, "tile": label(tile), "error": type(e).__name__})
            continue
        result = out["y"].float()
        if reference is None:
            reference = result
        err = float((result - reference).norm() / reference.norm())
        out_rows.append({"tokens": tokens, "I": intermediate, "tile": label(tile), "default": tile == default,
                         "us": seconds * 1e6, "x_floor": seconds * 1e6 / floor_us,
                         "tflops": flops / seconds / 1e12, "err_vs_default": err})
    return out_rows


def prefill_tiles() -> list[Tile]:
    shapes = [(128, 128, 64, 8), (128, 256, 64, 8), (128, 128, 128, 8), (64, 128, 64, 4), (64, 256, 64, 8),
              (256, 128, 64, 8)]
    tiles = [Tile(m, n, k, w, s) for (m, n, k, w), s in itertools.product(shapes, (3, 4))]
    # the launch order: groups of row blocks (as tuned fused-MoE configs use) on the likeliest tiles
    tiles += [Tile(m, n, 64, 8, s, g) for (m, n), s, g in itertools.product(((128, 128), (128, 256)), (3, 4), (1, 16))]
    # SiLU-and-mul in the first GEMM: block_n columns of gate and of up, so 128 reads what 256 does unfused
    tiles += [Tile(m, n, 64, 8, s, 1, fuse_silu=True) for (m, n), s in itertools.product(((128, 128), (128, 64),
                                                                                         (64, 128)), (3, 4))]
    return tiles


def decode_tiles() -> list[Tile]:
    """Decode batches (a few rows an expert, every expert's weights read): tiles that stream W."""
    tiles = [Tile(m, n, k, 8 if n == 256 else 4, s, 1) for m, n, k, s in itertools.product(
        (16, 32, 64), (64, 128, 256), (64, 128), (3, 4))]
    return tiles + [Tile(m, n, 128, 4, 3, 1, fuse_silu=True) for m, n in itertools.product((16, 32), (32, 64, 128))]


# tables: only the tile tables' tiles (with --fp8: FP8 experts in the unquantized experts' tiles too)
SWEEPS = {"prefill": (prefill_tiles, "2048,8192"), "decode": (decode_tiles, "32,64,128,256"),
          "tables": (list, "32,128,512,2048,8192")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", choices=sorted(SWEEPS), default="prefill", help="which tiles, at which token counts")
    parser.add_argument("--tokens", default=None, help="tokens per step (rows = tokens x 8; default: the sweep's)")
    parser.add_argument("--intermediates", default="768", help="expert intermediate size per rank (TP 1: 768, TP 2: 384)")
    parser.add_argument("--fp8", action="store_true", help="FP8 experts (128 x 128 blocks); also the tile tables' tiles")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    make_tiles, default_tokens = SWEEPS[args.sweep]
    tiles = make_tiles()
    if args.fp8:
        tiles = list(dict.fromkeys([t for _, t in FP8_TILES_BY_ROWS + TILES_BY_ROWS] + tiles))
    results, best = [], []
    for tokens, intermediate in itertools.product(map(int, (args.tokens or default_tokens).split(",")), map(int, args.intermediates.split(","))):
        rows = run_shape(tokens, intermediate, tiles, args.fp8)
        results += rows
        ok = sorted((r for r in rows if "us" in r and r["err_vs_default"] < 1e-2), key=lambda r: r["us"])
        print(f"\ntokens {tokens}, I {intermediate}: fastest 8 of {len(rows)} tiles (BLOCK_M x N x K, warps, stages, GROUP_M, +silu)")
        print_table(ok[:8], ["tile", "us", "x_floor", "tflops", "err_vs_default"])
        default = next(r for r in rows if r.get("default"))
        best.append({"tokens": tokens, "I": intermediate, "best": ok[0]["tile"], "best_us": ok[0]["us"],
                     "default": default["tile"], "default_us": default["us"], "speedup": default["us"] / ok[0]["us"],
                     "best_tflops": ok[0]["tflops"]})
    print("\nBest tile per shape against the default (kernels.moe.tiles_for)")
    print_table(best, list(best[0]))
    write_json(args.out, {"benchmark": "moe_tiles", "rows": results, "best": best})


if __name__ == "__main__":
    main()
