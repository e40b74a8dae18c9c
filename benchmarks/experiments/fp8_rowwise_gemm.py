"""FP8 GEMMs of weights scaled per row (compressed-tensors' per-channel checkpoints, RedHatAI's ``-FP8-dynamic``)
against bf16 cuBLAS at decode shapes: every linear of a model config, M tokens, each of

    w8a8         the Triton block GEMM reading the row scales as (1, 128) blocks (tpserve's GEMM above one token
                 before session 45): activations quantized per token and 128 features, scales applied per K step
    rowwise      ``kernels.fp8_gemm.fp8_gemm_rowwise``'s Triton kernel (activations quantized per token over all of
                 K, FP8 dots alone in the K loop, both scales in the epilogue); ``rowwise:BM=16:BN=64:BK=256:S=4:W=4``
                 other tiles
    engine       ``fp8_gemm_rowwise`` as the engine calls it (the Triton kernel up to ROWWISE_MAX_TOKENS, _scaled_mm above)
    scaled_mm    torch._scaled_mm with row-wise scales (cuBLASLt / CUTLASS), after the same activation quantization
    cuda         the CUDA GEMV with ``row_scales`` (one token)

Each is checked against its float32 torch reference (``bug``: must be ~1e-3) and timed as the replay of a CUDA
graph rotating over weight copies past the L2 (``gemm_small_m.time_calls``). Last: per M, one decoder layer's sum
against bf16.

    python benchmarks/experiments/fp8_rowwise_gemm.py --configs tests/data/configs/Qwen3-8B --ms 2,8,16,32,64,128
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks", "experiments"))
sys.path.insert(0, os.path.join(_ROOT, "python"))

import torch
import torch.nn.functional as F
from common import print_table, write_json
from fp8_gemm import linear_shapes, rel_err
from gemm_small_m import time_calls

from tpserve.kernels import gemv
from tpserve.kernels.fp8_gemm import RowwiseTiles, fp8_gemm, fp8_gemm_rowwise, quantize_activations, rowwise_tiles
from tpserve.quant.config import ROW_BLOCK
from tpserve.quant.fp8 import fp8_linear_reference, num_blocks, quantize_blocks, weight_only_reference

TILE_KEYS = {"BM": "block_m", "BN": "block_n", "BK": "block_k", "S": "num_stages", "W": "num_warps"}


def row_weights(n: int, k: int, copies: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(bf16, e4m3, scale [N, 1] (as the engine holds it), the scale repeated per 128 inputs (``w8a8``'s (1, 128)
    blocks)) per copy."""
    out = []
    for _ in range(copies):
        w = (0.02 * torch.randn(n, k, device="cuda", generator=gen)).to(torch.bfloat16)
        q, scale = quantize_blocks(w, (1, k))
        out.append((w, q, scale, scale.expand(n, num_blocks(k, ROW_BLOCK[1])).contiguous()))
    return out


def calls_for(variant: str, x: torch.Tensor, weights: list) -> list:
    name, *options = variant.split(":")
    m, k = x.shape
    if name == "bf16":
        return [lambda w=w: F.linear(x, w) for w, *_ in weights]
    if name == "w8a8":
        return [lambda q=q, b=b: fp8_gemm(x, q, b, ROW_BLOCK) for _, q, _, b in weights]
    if name == "rowwise":
        t = rowwise_tiles(m, weights[0][1].shape[0]).__dict__ | {TILE_KEYS[o.split("=")[0]]: int(o.split("=")[1]) for o in options}
        tiles = RowwiseTiles(**t)
        return [lambda q=q, s=s: fp8_gemm_rowwise(x, q, s, tiles) for _, q, s, _ in weights]
    if name == "engine":
        return [lambda q=q, s=s: fp8_gemm_rowwise(x, q, s) for _, q, s, _ in weights]
    if name == "scaled_mm":
        def call(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            a, sa = quantize_activations(x, k)
            return torch._scaled_mm(a, q.t(), scale_a=sa, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)
        return [lambda q=q, s=s: call(q, s) for _, q, s, _ in weights]
    if name == "cuda":
        return [lambda q=q, s=s: gemv.gemv(x, q, s, row_scales=True) for _, q, s, _ in weights]
    raise ValueError(variant)


def reference(variant: str, x: torch.Tensor, weights: list) -> torch.Tensor:
    w, q, scale, blocks = weights[0]
    name = variant.split(":")[0]
    if name == "bf16":
        return F.linear(x.float(), w.float())
    if name == "w8a8":
        return fp8_linear_reference(x.float(), q, blocks, ROW_BLOCK)
    if name == "cuda":
        return weight_only_reference(x.float(), q, scale, (1, x.shape[1]))
    return fp8_linear_reference(x.float(), q, scale, (1, x.shape[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="tests/data/configs/Qwen3-8B")
    parser.add_argument("--ms", default="2,8,16,32,64,128")
    parser.add_argument("--variants", default="w8a8,rowwise,scaled_mm")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--weight-set-mb", type=float, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    variants = ["bf16", *args.variants.split(",")]
    rows = []
    for model in args.configs.split(","):
        for linear, (n, k) in linear_shapes(model).items():
            copies = max(3, -(-int(args.weight_set_mb) // max(1, n * k // 2**20)))
            weights = row_weights(n, k, copies, gen)
            for m in [int(v) for v in args.ms.split(",")]:
                x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
                exact = x.double() @ weights[0][0].double().T
                row = {"config": os.path.basename(model.rstrip("/")), "linear": linear, "m": m, "n": n, "k": k}
                for v in variants:
                    if v.startswith("cuda") and m > gemv.ROW_SCALES_MAX_TOKENS:
                        continue
                    try:
                        calls = calls_for(v, x, weights)
                        out = calls[0]()
                        row[f"{v}_err"] = rel_err(out, exact)
                        row[f"{v}_bug"] = rel_err(out, reference(v, x, weights))
                        row[f"{v}_us"] = time_calls(calls, args.iters)[0] * 1e6
                    except Exception as e:  # noqa: BLE001 -- reported, the others still run
                        row[f"{v}_fail"] = f"{type(e).__name__}: {e}"[:160]
                        print(f"FAILED {linear} m={m} {v}: {row[f'{v}_fail']}", flush=True)
                rows.append(row)
            del weights
            torch.cuda.empty_cache()
    sums = []
    for config in sorted({r["config"] for r in rows}):
        for m in sorted({r["m"] for r in rows}):
            layer = [r for r in rows if r["config"] == config and r["m"] == m]
            total = {"config": config, "m": m}
            for v in variants:
                if all(r.get(f"{v}_us") is not None for r in layer):
                    total[f"{v}_us"] = sum(r[f"{v}_us"] for r in layer)
                    total[f"{v}_x"] = total[f"{v}_us"] / total["bf16_us"]
            sums.append(total)
    write_json(args.out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gemm": rows, "layer_sums": sums})
    print_table(rows, ["linear", "m", *[f"{v}_bug" for v in variants[1:]]])
    print_table(rows, ["linear", "m", *[f"{v}_us" for v in variants]])
    print_table(sums, ["config", "m", "bf16_us", *[f"{v}_x" for v in variants[1:]]])


if __name__ == "__main__":
    main()
