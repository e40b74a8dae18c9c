"""How fast the GPU reads a decode GEMV's weight in the order the one-token GEMVs read it, with no math.

The question it answers: is a one-token GEMV (``kernels/csrc/gemv.cu``) slower than its bytes because of
the order it reads them in (so no change to its math can help), or because of its math? Each linear of a
model (qkv, o, gate_up, down at TP 1) is read as a [rows, row_bytes] matrix, FP8 (one byte an element) and
bf16, by a Triton kernel whose programs read like the GEMV's blocks: R rows a program, each step one piece
of P bytes from each of the R rows (the FP8 GEMV: 8 rows x 2 KB; bf16: 2 rows x 8 KB), summed in int32 so
nothing is dead code. Variants: the same bytes read as one contiguous R x P run a step (``contig``), and
with Triton's software pipelining (``stages2``: the next step's loads issued before this step's sum, what
the GEMV cannot afford in registers). Timed like ``fp8_gemm.py``: a CUDA graph of calls rotating over
copies of the weight (>= 256 MB, so L2 holds none of it), the median replay. Last, the copy bandwidth of
the same run.

    python benchmarks/experiments/read_pattern.py --configs tests/data/configs/Qwen3-8B --out $OUT/read_pattern.json
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks", "experiments"))

import torch
import triton
import triton.language as tl
from common import copy_bandwidth, print_table, write_json
from fp8_gemm import linear_shapes
from gemm_small_m import time_calls


@triton.jit
def _read_rows(w_ptr, out_ptr, ROW_INTS: tl.constexpr, R: tl.constexpr, PIECE: tl.constexpr,
               CONTIG: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * R * ROW_INTS
    r = tl.arange(0, R)[:, None]
    j = tl.arange(0, PIECE)[None, :]
    acc = tl.zeros([R, PIECE], tl.int32)
    for s in tl.range(0, ROW_INTS // PIECE, num_stages=STAGES):
        if CONTIG:
            offs = base + s * R * PIECE + r * PIECE + j
        else:
            offs = base + r * ROW_INTS + s * PIECE + j
        acc += tl.load(w_ptr + offs, cache_modifier=".cg")
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


PATTERNS = {  # name: (rows a program, piece bytes, contiguous, pipeline stages)
    "fp8_gemv": (8, 2048, False, 1),
    "bf16_gemv": (2, 8192, False, 1),
    "contig": (8, 2048, True, 1),
    "stages2": (8, 2048, False, 2),
}


def read_calls(weights: list[torch.Tensor], rows: int, row_bytes: int, pattern: str) -> list:
    r, piece, contig, stages = PATTERNS[pattern]
    while row_bytes % piece:  # a piece divides the row (FP8 down's 12 KB rows: 4 KB pieces), as the GEMV's steps do
        piece //= 2
    out = torch.empty(rows // r, dtype=torch.int32, device="cuda")
    calls = []
    for w in weights:
        def call(w=w):
            _read_rows[(rows // r,)](w, out, ROW_INTS=row_bytes // 4, R=r, PIECE=piece // 4, CONTIG=contig,
                                     STAGES=stages, num_warps=4)
        calls.append(call)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="tests/data/configs/Qwen3-8B")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--weight-set-mb", type=float, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows_out = []
    for model in args.configs.split(","):
        for name, (n, k) in linear_shapes(model).items():
            for dtype, elem in (("fp8", 1), ("bf16", 2)):
                row_bytes = k * elem
                nbytes = n * row_bytes
                copies = max(2, int(args.weight_set_mb * 2**20 // nbytes) + 1)
                weights = [torch.randint(-2**31, 2**31 - 1, (n, row_bytes // 4), dtype=torch.int32, device="cuda")
                           for _ in range(copies)]
                row = {"model": os.path.basename(model), "linear": name, "dtype": dtype, "MB": nbytes / 1e6}
                for pattern in PATTERNS:
                    seconds, _ = time_calls(read_calls(weights, n, row_bytes, pattern), args.iters)
                    row[f"{pattern}_us"] = seconds * 1e6
                    row[f"{pattern}_TBps"] = nbytes / seconds / 1e12
                rows_out.append(row)
                del weights
                torch.cuda.empty_cache()
    bandwidth = copy_bandwidth()
    print_table(rows_out, ["model", "linear", "dtype", "MB"] + [f"{p}_TBps" for p in PATTERNS] + ["fp8_gemv_us"])
    print(f"copy bandwidth (read + write) {bandwidth / 1e12:.2f} TB/s")
    write_json(args.out, {"rows": rows_out, "copy_bandwidth": bandwidth})


if __name__ == "__main__":
    main()
