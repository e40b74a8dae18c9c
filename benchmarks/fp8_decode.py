"""FP8 against bf16: the decode step at batch 1, and the FP8 GEMM's speed and accuracy.

Part 1 (``--configs``): for each model config (random weights, ``load_format="dummy"``) a bf16
engine and then an FP8 engine (``quantization="fp8"``: 128x128 block scales, the published
format) decode at batch 1 (CUDA graphs), in the same process one after the other; the
ratio fp8 / bf16 is the issue's target (<= 0.6).

Part 2: every linear of each config at M in ``--gemm-m``: time and relative L2 error against a
float64 reference of bf16 ``F.linear``, tpserve's Triton FP8 GEMM (activation quantization
included) and torch's block-scaled ``F.scaled_mm`` (1x128 activation / 128x128 weight scales)
where this torch and GPU have it (its error is reported, or why it could not run).

    python benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B,tests/data/configs/Qwen3-32B \
        --out out/fp8_decode.json
"""

from __future__ import annotations

import argparse
import gc
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import device_name, fill_kv_randomly, make_engine, print_table, setup_logging, time_cuda, write_json
from decode_latency import time_decode
from tpserve.config import ModelConfig
from tpserve.quant.fp8 import quantize_blocks

BLOCK = (128, 128)


def decode_step_ms(model: str, quantization: str | None, context: int, warmup: int, iters: int) -> dict:
    engine = make_engine(model, quantization=quantization, max_total_tokens=4 * context, cuda_graph_max_bs=1)
    fill_kv_randomly(engine)
    weight_gib = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**30
    seconds = time_decode(engine, 1, context, warmup, iters)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return {"step_ms": None if seconds is None else seconds * 1e3, "weight_gib": weight_gib}


def linear_shapes(model: str) -> dict[str, tuple[int, int]]:
    cfg = ModelConfig.from_pretrained(model)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "qkv": (q + 2 * kv, cfg.hidden_size), "o": (cfg.hidden_size, q),
        "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size),
    }


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).norm() / expected.norm())


def scaled_mm_blockwise(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch's block-scaled FP8 matmul (cuBLAS/CUTLASS on sm90), activation quantized in torch."""
    from tpserve.quant.fp8 import quantize_activations

    xq, xs = quantize_activations(x, BLOCK[1])
    return F.scaled_mm(
        xq, wq.t(), xs.t().contiguous().t(), F.ScalingType.BlockWise1x128,
        scale.t().contiguous().t(), F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16,
    )


def gemm_rows(model: str, ms: list[int]) -> list[dict]:
    from tpserve.kernels.fp8_gemm import fp8_linear

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in linear_shapes(model).items():
        w = (0.02 * torch.randn(n, k, device="cuda", generator=gen)).to(torch.bfloat16)
        wq, scale = quantize_blocks(w, BLOCK)
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            exact = x.double() @ w.double().T
            row: dict = {"config": model.rstrip("/").rsplit("/", 1)[-1], "linear": name, "m": m, "n": n, "k": k}
            variants: dict[str, Callable[[], torch.Tensor]] = {
                "bf16": lambda: F.linear(x, w),
                "fp8_triton": lambda: fp8_linear(x, wq, scale, BLOCK),
                "fp8_scaled_mm": lambda: scaled_mm_blockwise(x, wq, scale),
            }
            for label, fn in variants.items():
                try:
                    row[f"{label}_err"] = rel_err(fn(), exact)
                    row[f"{label}_us"] = time_cuda(fn, warmup=5, iters=50) * 1e6
                except Exception as e:  # noqa: BLE001 -- reported, the others still run
                    row[f"{label}_err"] = f"failed: {type(e).__name__}: {e}"[:200]
            rows.append(row)
            del x, exact
        del w, wq, scale
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="tests/data/configs/Qwen3-8B,tests/data/configs/Qwen3-32B",
                        help="comma-separated directories with a config.json (weights are random)")
    parser.add_argument("--context", type=int, default=512, help="cached tokens of the decoding sequence")
    parser.add_argument("--gemm-m", default="1,16,256", help="token counts for the GEMM part")
    parser.add_argument("--skip-decode", action="store_true", help="only the GEMM part")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    setup_logging()
    configs = [c for c in args.configs.split(",") if c]
    decode = []
    if not args.skip_decode:
        for model in configs:
            row: dict = {"config": model.rstrip("/").rsplit("/", 1)[-1], "context": args.context}
            for label, quant in (("bf16", None), ("fp8", "fp8")):
                try:
                    result = decode_step_ms(model, quant, args.context, args.warmup, args.iters)
                    row[f"{label}_ms"], row[f"{label}_weight_gib"] = result["step_ms"], result["weight_gib"]
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row[f"{label}_ms"] = f"failed: {type(e).__name__}: {e}"[:200]
            if isinstance(row.get("bf16_ms"), float) and isinstance(row.get("fp8_ms"), float):
                row["fp8_over_bf16"] = row["fp8_ms"] / row["bf16_ms"]
            decode.append(row)
        print_table(decode, ["config", "context", "bf16_ms", "fp8_ms", "fp8_over_bf16", "bf16_weight_gib", "fp8_weight_gib"])
    gemm = [r for model in configs for r in gemm_rows(model, [int(m) for m in args.gemm_m.split(",")])]
    print_table(gemm, ["config", "linear", "m", "bf16_us", "fp8_triton_us", "fp8_scaled_mm_us", "bf16_err",
                       "fp8_triton_err", "fp8_scaled_mm_err"])
    write_json(args.out, {"device": device_name(), "torch": torch.__version__, "decode": decode, "gemm": gemm})


if __name__ == "__main__":
    main()
