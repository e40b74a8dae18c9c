"""fp8_gemv's parameters per linear at few tokens: for each linear of a model config (qkv, o,
gate_up, down at TP 1) and token count, bf16 cuBLAS, FlashInfer's FP8 GEMM and fp8_gemv's
default config, then a sweep of (block_n, block_k, split_k, num_warps, num_stages, prefetch)
around 4-16 KB tiles, and the best config with programmatic dependent launch. Timed as
``fp8_gemm.py`` does (a CUDA graph of calls rotating over weight copies past the L2, median
replay); each config is checked against the torch reference (``bug`` < 2e-2) before it counts.
Prints us and TB/s (weight bytes / time) per config, the best per linear against the default,
bf16 and the copy bandwidth, and the best configs as ``default_config`` would return them.

    python benchmarks/experiments/fp8_gemv_sweep.py --configs tests/data/configs/Qwen3-8B --ms 1 \
        --out $OUT/fp8_gemv_sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch
from fp8_gemm import Weights, copy_bandwidth, linear_shapes, measure, print_table, write_json  # sets up sys.path

from tpserve.kernels.fp8_gemv import FMA_MAX_TOKENS, GemvConfig, default_config, fma_block_k


def candidates(m: int, n: int, k: int, sm_count: int) -> list[GemvConfig]:
    """Tiles of 4-16 KB: rows of 512-1024 bytes with 4 warps (2-8 16-byte loads a thread; 16 KB
    tiles also 8 warps), rows of 128 bytes (one scale group: the flat accumulation at one token)
    with one or two loads a thread; also split along K where the features give under three
    programs per SM (into enough for three); each with the register prefetch alone, Triton's
    pipeliner alone or both."""
    block_m = triton_pow2(m)
    out = []
    tiles = [*itertools.product((8, 16, 32), (256, 512, 1024)), (32, 128), (64, 128), (128, 128)]  # 128: one scale group
    for block_n, want_k in tiles:
        block_k = fma_block_k(k, 128, want_k)
        tile = block_n * block_k
        if not 4096 <= tile <= 16384:
            continue
        split = 1
        while -(-n // block_n) * split < 3 * sm_count and k // (2 * split) >= 2 * block_k:
            split *= 2
        splits = sorted({1, split})
        for warps, split, (prefetch, stages) in itertools.product(
            ((4, 8) if tile == 16384 else (4,)) if block_k > 128 else (tile // 512, tile // 1024), splits,
            ((True, 1), (False, 3), (True, 2))
        ):
            out.append(GemvConfig(block_m, block_n, block_k, split, warps, stages, prefetch=prefetch))
    return out


def triton_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


def timed(name: str, x: torch.Tensor, wts: Weights, exact: torch.Tensor, iters: int, config=None) -> dict:
    try:
        r = measure(name, x, wts, exact, iters, config)
    except Exception as e:  # noqa: BLE001 -- a config that does not compile or run is reported and skipped
        return {"fail": f"{type(e).__name__}: {e}"[:160]}
    return r if r["bug"] < 2e-2 else {**r, "fail": f"wrong result: relative error {r['bug']:.2e} against torch"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="tests/data/configs/Qwen3-8B", help="comma-separated config directories")
    parser.add_argument("--ms", default="1", help=f"token counts (up to {FMA_MAX_TOKENS}: the CUDA-core kernel)")
    parser.add_argument("--iters", type=int, default=10, help="timed graph replays")
    parser.add_argument("--weight-set-mb", type=float, default=256, help="weight bytes rotated over per config")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, best_rows = [], []
    for model in [c for c in args.configs.split(",") if c]:
        config_name = model.rstrip("/").rsplit("/", 1)[-1]
        for name, (n, k) in linear_shapes(model).items():
            copies = max(3, -(-int(args.weight_set_mb) // max(n * k // 2**20, 1)))
            wts = Weights(n, k, copies, gen)
            for m in [int(v) for v in args.ms.split(",")]:
                x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
                exact = x.double() @ wts.bf16[0].double().T
                base = {"config": config_name, "linear": name, "m": m, "n": n, "k": k}
                summary = {**base, "bf16_us": timed("bf16", x, wts, exact, args.iters).get("us"),
                           "flashinfer_us": timed("flashinfer", x, wts, exact, args.iters).get("us")}
                default = default_config(m, n, k, 128, sm_count)
                best = None
                for config in [default, *candidates(m, n, k, sm_count)]:
                    r = timed("gemv", x, wts, exact, args.iters, config)
                    row = {**base, "gemv": str(config), **r, "tb_s": n * k / r["us"] / 1e6 if "us" in r else None}
                    rows.append(row)
                    print({key: (round(v, 4) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
                    if config == default:
                        summary["default_us"] = r.get("us")
                    if "fail" not in r and (best is None or r["us"] < best[1]["us"]):
                        best = (config, r)
                if best is not None:
                    pdl = timed("gemv", x, wts, exact, args.iters, dataclasses.replace(best[0], pdl=True))
                    summary.update(best_us=best[1]["us"], best_tb_s=n * k / best[1]["us"] / 1e6, best_config=str(best[0]),
                                   best_pdl_us=pdl.get("us"), pdl_fail=pdl.get("fail"))
                best_rows.append(summary)
                print("BEST", {key: (round(v, 3) if isinstance(v, float) else v) for key, v in summary.items()}, flush=True)
                write_json(args.out, {"partial": True, "configs": rows, "best": best_rows})  # kept if the time runs out
            del wts
            torch.cuda.empty_cache()
    bandwidth = copy_bandwidth()
    sums = []
    for (config_name, m), group in itertools.groupby(sorted(best_rows, key=lambda r: (r["config"], r["m"])), key=lambda r: (r["config"], r["m"])):
        group = list(group)
        total = {"config": config_name, "m": m}
        for key in ("bf16_us", "flashinfer_us", "default_us", "best_us", "best_pdl_us"):
            if all(r.get(key) is not None for r in group):
                total[key] = sum(r[key] for r in group)
                if key != "bf16_us" and total.get("bf16_us"):
                    total[key.replace("_us", "_x")] = total[key] / total["bf16_us"]
        sums.append(total)
    write_json(args.out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sm_count": sm_count,
                          "copy_bandwidth_bytes_per_s": bandwidth, "configs": rows, "best": best_rows, "layer_sums": sums})
    print_table(best_rows, ["config", "linear", "m", "bf16_us", "flashinfer_us", "default_us", "best_us", "best_tb_s",
                            "best_pdl_us", "best_config"])
    print_table(sums, ["config", "m", "bf16_us", "flashinfer_x", "default_x", "best_x", "best_pdl_x"])
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written); TB/s above counts weight bytes read")


if __name__ == "__main__":
    main()
