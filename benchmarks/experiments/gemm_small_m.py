"""Small-M linear layers: torch F.linear (cuBLAS) against tpserve's Triton ``small_m_linear``,
on the linear shapes of real model configs (qkv, o, gate_up, down, lm_head), M = 1..64 tokens.

Each (shape, M, implementation) is checked once against F.linear in float32 (max |y - ref| /
max |ref|), then timed as the replay of a CUDA graph of calls that rotate over copies of the
weight (at least 3, and at least --weight-set-mb in all, so no call finds its weight in the
50 MB L2), CUDA events around each replay, the median replay over the calls in it. The graph
also holds the gaps between kernels, as the engine's decode step does. Triton runs the default
config (``default_config``) and a fixed sweep of candidate configs (split-K chosen per shape by
``auto_split_k``); a config that fails to compile or gives a wrong result is reported and
skipped. Then the sum over each model's decoder (layers x 4 linears + lm_head) at the smallest
and largest M, and the device copy bandwidth measured in the same run.

    python benchmarks/experiments/gemm_small_m.py --models .models/Qwen3-0.6B,.models/Qwen3-8B,.models/Qwen3-14B \\
        --out out/gemm_small_m.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

# benchmarks/common.py; and, from a checkout where tpserve is not installed, the checkout's python/.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
if importlib.util.find_spec("tpserve") is None:
    sys.path.insert(0, os.path.join(_ROOT, "python"))

import torch
import torch.nn.functional as F
from common import copy_bandwidth, print_table, time_cuda, write_json
from small_m_gemm_kernel import (
    SmallMConfig,
    auto_split_k,
    default_config,
    small_m_linear,
)

# Candidate configs; split_k is filled in per shape by auto_split_k. fma (CUDA cores) only where
# its [M, BLOCK_N, BLOCK_K] product stays in registers: M <= 8 and M * BLOCK_N <= 64.
SWEEP = (
    SmallMConfig(variant="dot_t", block_n=16, block_k=256, num_warps=4, num_stages=4),
    SmallMConfig(variant="dot_t", block_n=16, block_k=512, num_warps=4, num_stages=3),
    SmallMConfig(variant="dot_t", block_n=32, block_k=256, num_warps=4, num_stages=4),
    SmallMConfig(variant="dot_t", block_n=32, block_k=128, num_warps=4, num_stages=6),
    SmallMConfig(variant="dot_t", block_n=64, block_k=128, num_warps=4, num_stages=4),
    SmallMConfig(variant="dot_t", block_n=64, block_k=256, num_warps=4, num_stages=3),
    SmallMConfig(variant="dot_t", block_n=128, block_k=128, num_warps=8, num_stages=3),
    SmallMConfig(variant="dot", block_n=32, block_k=256, num_warps=4, num_stages=4),
    SmallMConfig(variant="dot", block_n=64, block_k=128, num_warps=4, num_stages=4),
    SmallMConfig(variant="fma", block_n=4, block_k=512, num_warps=4, num_stages=4),
    SmallMConfig(variant="fma", block_n=8, block_k=256, num_warps=4, num_stages=4),
    SmallMConfig(variant="fma", block_n=16, block_k=128, num_warps=4, num_stages=4),
)
LINEARS = ("qkv", "o", "gate_up", "down", "lm_head")
_REPORTED: set[str] = set()


def linear_shapes(config: dict, tp: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of one tensor-parallel rank's linears, as torch Linear weights [N, K]."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    # Past tp == kv_heads the kv heads are replicated: one per rank.
    q_rank, kv_rank = heads // tp, max(1, kv_heads // tp)
    return [
        ("qkv", (q_rank + 2 * kv_rank) * head_dim, hidden),
        ("o", hidden, q_rank * head_dim),
        ("gate_up", 2 * inter // tp, hidden),
        ("down", hidden, inter // tp),
        ("lm_head", -(-vocab // tp), hidden),
    ]


def sweep_configs(m: int, n: int, k: int, num_sms: int) -> list[SmallMConfig]:
    configs = []
    for template in SWEEP:
        if template.variant == "fma" and (m > 8 or m * template.block_n > 64):
            continue
        split = auto_split_k(n, k, template.block_n, template.block_k, num_sms)
        config = dataclasses.replace(template, split_k=split)
        if config not in configs:
            configs.append(config)
    return configs


def time_calls(calls: list[Callable[[], object]], iters: int) -> tuple[float, str]:
    """Median seconds per call, and how: replays of one CUDA graph of all the calls, or (when
    capture fails) eager runs of them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # Warm-up off the default stream, as torch's CUDA graph docs ask.
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
    except Exception as exc:  # noqa: BLE001 -- fall back to eager timing, reported in the row
        print(
            f"    graph capture failed ({type(exc).__name__}: {exc}); timing eagerly",
            flush=True,
        )
        torch.cuda.synchronize()
        seconds = time_cuda(lambda: [call() for call in calls], warmup=2, iters=iters)
        return seconds / len(calls), "eager"
    graph.replay()
    times = []
    for _ in range(iters):
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times) / len(calls), "graph"


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def measure(
    name: str,
    fn: Callable[[torch.Tensor], torch.Tensor],
    weights: list[torch.Tensor],
    ref: torch.Tensor,
    args: argparse.Namespace,
) -> dict:
    """{"us", "err", "mode", "first_call_s"} or {"error"} for one implementation."""
    try:
        start = time.perf_counter()
        y = fn(weights[0])
        torch.cuda.synchronize()
        first_call = time.perf_counter() - start  # with Triton's compile on first use
        err = relative_error(y, ref)
        if not math.isfinite(err) or err > args.tolerance:
            return {
                "error": f"wrong result: relative error {err:.3g} > {args.tolerance}",
                "err": err,
            }
        seconds, mode = time_calls([lambda w=w: fn(w) for w in weights], args.iters)
    except Exception as exc:  # noqa: BLE001 -- a failing config is reported and skipped
        lines = str(exc).strip().splitlines() or [""]
        message = f"{type(exc).__name__}: {lines[0][:200]}"
        if name not in _REPORTED:  # once per config, not once per shape
            _REPORTED.add(name)
            print(f"    {name}: FAILED {message}", flush=True)
        return {"error": message}
    return {"us": seconds * 1e6, "err": err, "mode": mode, "first_call_s": first_call}


def bench_shape(
    model: str, linear: str, n: int, k: int, args: argparse.Namespace, num_sms: int
) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    weight_bytes = n * k * dtype.itemsize
    copies = max(3, math.ceil(args.weight_set_mb * 1e6 / weight_bytes))
    weights = [
        torch.randn(n, k, dtype=dtype, device="cuda").mul_(k**-0.5)
        for _ in range(copies)
    ]
    weight_f32 = weights[0].float()
    rows = []
    for m in args.ms:
        x = torch.randn(m, k, dtype=dtype, device="cuda")
        ref = F.linear(x.float(), weight_f32)
        row = {
            "model": model,
            "linear": linear,
            "N": n,
            "K": k,
            "M": m,
            "weight_bytes": weight_bytes,
            "copies": copies,
        }
        cublas = measure("cuBLAS", lambda w, x=x: F.linear(x, w), weights, ref, args)
        default = default_config(m, n, k, num_sms)
        configs = [default] + [
            c
            for c in (sweep_configs(m, n, k, num_sms) if args.sweep else [])
            if c != default
        ]
        results = {}
        for config in configs:
            results[str(config)] = measure(
                str(config),
                lambda w, x=x, c=config: small_m_linear(x, w, None, c),
                weights,
                ref,
                args,
            )
        timed = {c: r for c, r in results.items() if "us" in r}
        best = min(timed, key=lambda c: timed[c]["us"]) if timed else None
        row.update(
            cublas_us=cublas.get("us", float("nan")),
            cublas_TBps=weight_bytes / cublas["us"] / 1e6
            if "us" in cublas
            else float("nan"),
            cublas_err=cublas.get("err", float("nan")),
            best_us=timed[best]["us"] if best else float("nan"),
            best_TBps=weight_bytes / timed[best]["us"] / 1e6 if best else float("nan"),
            best_config=best or "-",
            default_us=results[str(default)].get("us", float("nan")),
            default_config=str(default),
            speedup=cublas.get("us", float("nan")) / timed[best]["us"]
            if best
            else float("nan"),
            default_speedup=cublas.get("us", float("nan"))
            / results[str(default)].get("us", float("nan")),
            cublas=cublas,
            configs=results,
        )
        rows.append(row)
        print(
            f"{model:>12} {linear:>8} N={n:>6} K={k:>6} M={m:>2}: cuBLAS {row['cublas_us']:8.2f} us "
            f"({row['cublas_TBps']:.2f} TB/s), Triton best {row['best_us']:8.2f} us ({row['best_TBps']:.2f} TB/s, "
            f"{row['best_config']}), default {row['default_us']:8.2f} us",
            flush=True,
        )
    del weights, weight_f32
    torch.cuda.empty_cache()
    return rows


def stack_sums(
    model: str, layers: int, rows: list[dict], bandwidth: float
) -> list[dict]:
    """One decode step's linears: layers x (qkv + o + gate_up + down) + lm_head, per M."""
    sums = []
    for m in sorted({r["M"] for r in rows}):
        by_linear = {r["linear"]: r for r in rows if r["M"] == m}
        if set(by_linear) != set(LINEARS):
            continue
        count = {name: 1 if name == "lm_head" else layers for name in LINEARS}

        def total(
            value: Callable[[dict], float],
            by_linear: dict = by_linear,
            count: dict = count,
        ) -> float:
            return sum(count[name] * value(by_linear[name]) for name in LINEARS)

        weight_bytes = total(lambda r: r["weight_bytes"])
        entry = {
            "model": model,
            "M": m,
            "layers": layers,
            "weight_GB": weight_bytes / 1e9,
            "floor_ms": weight_bytes / bandwidth * 1e3,
            "cublas_ms": total(lambda r: r["cublas_us"]) / 1e3,
            "default_ms": total(lambda r: r["default_us"]) / 1e3,
            "best_ms": total(lambda r: r["best_us"]) / 1e3,
            # cuBLAS or the best Triton config, whichever is faster for each shape
            "best_of_both_ms": total(lambda r: min(r["cublas_us"], r["best_us"])) / 1e3,
        }
        entry["default_speedup"] = entry["cublas_ms"] / entry["default_ms"]
        entry["best_speedup"] = entry["cublas_ms"] / entry["best_ms"]
        sums.append(entry)
    return sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default=".models/Qwen3-0.6B,.models/Qwen3-8B,.models/Qwen3-14B",
        help="comma-separated model directories, each with a config.json",
    )
    parser.add_argument(
        "--ms",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[1, 2, 4, 8, 16, 32, 64],
    )
    parser.add_argument(
        "--tp", type=int, default=1, help="shapes of one tensor-parallel rank"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=15, help="timed graph replays")
    parser.add_argument(
        "--weight-set-mb",
        type=float,
        default=200.0,
        help="rotated weight copies total at least this",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=2e-2,
        help="max relative error before a config is wrong",
    )
    parser.add_argument(
        "--no-sweep", dest="sweep", action="store_false", help="default config only"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference is float32
    torch.manual_seed(0)
    started = time.perf_counter()

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth = copy_bandwidth()
    print(
        f"{torch.cuda.get_device_name()}: {num_sms} SMs, copy bandwidth {bandwidth / 1e12:.2f} TB/s "
        f"(read + write), {args.dtype}, tp {args.tp}",
        flush=True,
    )

    rows, stacks = [], []
    for model_dir in args.models.split(","):
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        model = os.path.basename(os.path.normpath(model_dir))
        model_rows = []
        for linear, n, k in linear_shapes(config, args.tp):
            model_rows += bench_shape(model, linear, n, k, args, num_sms)
        rows += model_rows
        stacks += stack_sums(model, config["num_hidden_layers"], model_rows, bandwidth)

    first_calls = sum(
        r2.get("first_call_s", 0.0) for r in rows for r2 in r["configs"].values()
    )
    failed = sorted(
        {c for r in rows for c, r2 in r["configs"].items() if "error" in r2}
    )
    elapsed = time.perf_counter() - started
    print(
        f"\n{elapsed:.0f} s in all, {first_calls:.0f} s of it in first calls (Triton compiles)"
    )
    if failed:
        print(
            "configs that failed or were wrong somewhere (see the JSON's rows[*].configs):"
        )
        for config in failed:
            print(f"  {config}")

    ms = [min(args.ms), max(args.ms)]
    print(
        f"\nOne decode step's linears (layers x 4 + lm_head); floor = weight bytes / copy bandwidth "
        f"{bandwidth / 1e12:.2f} TB/s"
    )
    print_table(
        [s for s in stacks if s["M"] in ms],
        [
            "model",
            "M",
            "weight_GB",
            "floor_ms",
            "cublas_ms",
            "default_ms",
            "best_ms",
            "best_of_both_ms",
            "default_speedup",
            "best_speedup",
        ],
    )
    print(
        f"\nPer shape ({args.dtype}, tp {args.tp}); TB/s = weight bytes / time; speedup = cuBLAS / Triton"
    )
    print_table(
        rows,
        [
            "model",
            "linear",
            "N",
            "K",
            "M",
            "cublas_us",
            "cublas_TBps",
            "best_us",
            "best_TBps",
            "best_config",
            "default_us",
            "speedup",
            "default_speedup",
        ],
    )
    write_json(
        args.out,
        {
            "benchmark": "gemm_small_m",
            "copy_bandwidth_Bps": bandwidth,
            "num_sms": num_sms,
            "dtype": args.dtype,
            "tp": args.tp,
            "ms": args.ms,
            "sweep": [str(c) for c in SWEEP],
            "seconds": elapsed,
            "stacks": stacks,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
