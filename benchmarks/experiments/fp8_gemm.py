"""FP8 GEMMs against bf16 cuBLAS at decode shapes: every linear of a model config (qkv, o, gate_up,
down at TP 1), M tokens (default 1, 16, 64), each GEMM tpserve can run (``kernels.fp8_linear``):

    bf16         F.linear on the bf16 weight (cuBLAS): the baseline
    w8a8         the Triton block GEMM, activations quantized (``triton``; ``cuda_triton`` above one token)
    flashinfer   FlashInfer's fp8_blockscale_gemm_sm90 (``flashinfer``; ``cuda`` above one token)
    cuda         the CUDA GEMV on the FP8 weight (``kernels.gemv``; ``cuda`` and ``cuda_triton`` at one token;
                 timed up to 8)
    bf16_cuda    the CUDA GEMV on the bf16 weight (``TPSERVE_BF16_GEMV=1`` at <= 8 tokens)

A CUDA GEMV variant may carry options after colons: ``nopdl`` (launched without programmatic
dependent launch) and ``NAME=VALUE`` (a ``TPSERVE_GEMV_NAME`` constant of ``csrc/gemv.cu``, built as
its own module), e.g. ``cuda:FP8_ROWS=16:FP8_LOADS=16``. ``--after-norm`` puts FlashInfer's RMSNorm
(PDL-launched, as in the model) before each GEMM, since PDL lets a GEMV start during the kernel that
writes its input; the times then include that norm.

A config whose MLPs are all MoE (Qwen3-30B-A3B) times only qkv and o; ``--tp`` times one rank's
shards (qkv, gate_up split N; o, down split K).

Each is checked once: its relative L2 error against the float64 product of the unquantized
weights (``err``; bf16's own is the floor), and against the float32 torch reference of what it
should compute (``bug``: must be ~1e-3, else the kernel is wrong). Then timed as the replay of a
CUDA graph of calls rotating over copies of the weights (at least ``--weight-set-mb`` in all, so
no call finds its weight in the 50 MB L2), the median replay over the calls in it; the graph
also holds the gaps between kernels, as the engine's decode step does (``gemm_small_m.time_calls``). A variant that fails
reports why and the others still run. Last: per M, the sum over one decoder layer's four
linears, bf16 against each FP8 GEMM, and the copy bandwidth measured in the same run.

    python benchmarks/experiments/fp8_gemm.py --configs tests/data/configs/Qwen3-8B --out $OUT/fp8_gemm.json
    python benchmarks/experiments/fp8_gemm.py --configs tests/data/configs/Qwen3-32B,tests/data/configs/Qwen3-30B-A3B \
        --ms 1,2,4,8 --variants cuda,bf16_cuda,flashinfer,w8a8
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
if importlib.util.find_spec("tpserve") is None:
    sys.path.insert(0, os.path.join(_ROOT, "python"))

import torch
import torch.nn.functional as F
from common import copy_bandwidth, print_table, write_json
from gemm_small_m import time_calls

from tpserve.config import ModelConfig
from tpserve.quant.fp8 import fp8_linear_reference, quantize_blocks, weight_only_reference

BLOCK = (128, 128)
FP8_VARIANTS = ("w8a8", "flashinfer", "cuda")
VARIANTS = (*FP8_VARIANTS, "bf16_cuda")
CUDA_GEMV_TOKENS = 8  # kernels.gemv.MAX_TOKENS


def linear_shapes(model: str, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(N, K) of one rank's dense linears; qkv and o only where every MLP is MoE."""
    cfg = ModelConfig.from_pretrained(model)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"qkv": ((q + 2 * kv) // tp, cfg.hidden_size), "o": (cfg.hidden_size, q // tp)}
    if cfg.dense_layers:
        shapes |= {"gate_up": (2 * cfg.intermediate_size // tp, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size // tp)}
    return shapes


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


class Weights:
    """One linear's weights in every form the variants read, ``copies`` times over."""

    def __init__(self, n: int, k: int, copies: int, gen: torch.Generator) -> None:
        self.bf16 = [(0.02 * torch.randn(n, k, device=gen.device, generator=gen)).to(torch.bfloat16) for _ in range(copies)]
        self.block = [quantize_blocks(w, BLOCK) for w in self.bf16]


def parse_variant(variant: str) -> tuple[str, dict]:
    """``cuda:nopdl:FP8_ROWS=16`` -> ("cuda", {"pdl": False, "defines": (("FP8_ROWS", 16),)})."""
    base, *options = variant.split(":")
    defines = tuple((o.split("=")[0], int(o.split("=")[1])) for o in options if "=" in o)
    return base, {"pdl": "nopdl" not in options, "defines": defines}


def variant_calls(variant: str, x: torch.Tensor, wts: Weights, norm_weight: torch.Tensor | None) -> list[Callable[[], torch.Tensor]]:
    from tpserve.kernels.fp8_gemm import fp8_gemm
    from tpserve.kernels.gemv import gemv, load_module

    name, options = parse_variant(variant)
    if norm_weight is not None:  # each call: RMSNorm into x's buffer, then the GEMM on it
        from flashinfer.norm import rmsnorm

        source = x.clone()
        inner = variant_calls(variant, x, wts, None)
        return [lambda f=f: (rmsnorm(source, norm_weight, 1e-6, out=x), f())[1] for f in inner]
    if name in ("cuda", "bf16_cuda"):
        module, pdl = load_module(options["defines"]), options["pdl"]
        if name == "cuda":
            return [lambda w=w, s=s: gemv(x, w, s, module=module, pdl=pdl) for w, s in wts.block]
        return [lambda w=w: gemv(x, w, module=module, pdl=pdl) for w in wts.bf16]
    if name == "bf16":
        return [lambda w=w: F.linear(x, w) for w in wts.bf16]
    if name == "w8a8":
        return [lambda w=w, s=s: fp8_gemm(x, w, s, BLOCK) for w, s in wts.block]
    if name == "flashinfer":
        from flashinfer.gemm import fp8_blockscale_gemm_sm90

        return [lambda w=w, s=s: fp8_blockscale_gemm_sm90(x, w, None, s, out_dtype=x.dtype) for w, s in wts.block]
    raise ValueError(name)


def reference(variant: str, x: torch.Tensor, wts: Weights) -> torch.Tensor:
    """The float32 torch reference of what ``variant`` computes."""
    name, _ = parse_variant(variant)
    w, s = wts.block[0]
    if name in ("bf16", "bf16_cuda"):
        return F.linear(x.float(), wts.bf16[0].float())
    if name == "cuda":
        return weight_only_reference(x.float(), w, s, BLOCK)
    return fp8_linear_reference(x.float(), w, s, BLOCK)


def measure(name: str, x: torch.Tensor, wts: Weights, exact: torch.Tensor, iters: int, norm_weight: torch.Tensor | None) -> dict:
    calls = variant_calls(name, x, wts, norm_weight)
    out = calls[0]()
    result = {"err": rel_err(out, exact), "bug": rel_err(out, reference(name, x, wts))}
    seconds, how = time_calls(calls, iters)
    result["us"] = seconds * 1e6
    if how != "graph":
        print(f"    {name}: timed {how}ly (graph capture failed)", flush=True)
    return result


def bench_linear(model: str, name: str, n: int, k: int, ms: list[int], args, gen: torch.Generator) -> list[dict]:
    bf16_mb = n * k * 2 / 2**20
    copies = max(3, -(-int(args.weight_set_mb) // int(max(bf16_mb / 2, 1))))
    wts = Weights(n, k, copies, gen)
    rows = []
    norm_weight = torch.ones(k, device="cuda", dtype=torch.bfloat16) if args.after_norm else None
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        if norm_weight is not None:  # x as the norm leaves it, so the references hold
            from flashinfer.norm import rmsnorm

            x = rmsnorm(x, norm_weight, 1e-6)
        exact = x.double() @ wts.bf16[0].double().T
        row: dict = {"config": model.rstrip("/").rsplit("/", 1)[-1], "linear": name, "m": m, "n": n, "k": k}
        for variant in ("bf16", *args.variants.split(",")):
            if parse_variant(variant)[0] in ("cuda", "bf16_cuda") and m > CUDA_GEMV_TOKENS:
                continue
            try:
                r = measure(variant, x, wts, exact, args.iters, norm_weight)
                row[f"{variant}_us"], row[f"{variant}_err"], row[f"{variant}_bug"] = r["us"], r["err"], r["bug"]
                if variant != "bf16":
                    row[f"{variant}_x"] = r["us"] / row["bf16_us"]
            except Exception as e:  # noqa: BLE001 -- reported, the others still run
                if args.verbose:
                    traceback.print_exc()
                row[f"{variant}_us"] = None
                row[f"{variant}_fail"] = f"{type(e).__name__}: {e}"[:160]
        fp8 = [v for v in args.variants.split(",") if parse_variant(v)[0] in FP8_VARIANTS]
        bf16 = ["bf16", *(v for v in args.variants.split(",") if parse_variant(v)[0] == "bf16_cuda")]
        row["fp8_gbps"] = n * k / (min(row.get(f"{v}_us") or 1e9 for v in fp8 or ["-"]) * 1e-6) / 1e9
        row["bf16_gbps"] = 2 * n * k / (min(row.get(f"{v}_us") or 1e9 for v in bf16) * 1e-6) / 1e9
        rows.append(row)
        print({key: (round(v, 4) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
    del wts
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="tests/data/configs/Qwen3-8B", help="comma-separated config directories")
    parser.add_argument("--ms", default="1,16,64", help="token counts")
    parser.add_argument("--iters", type=int, default=15, help="timed graph replays")
    parser.add_argument("--weight-set-mb", type=float, default=256, help="weight bytes rotated over per variant")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="GEMMs to run beside bf16 cuBLAS")
    parser.add_argument("--tp", type=int, default=1, help="time one rank's shards at this tensor-parallel size")
    parser.add_argument("--after-norm", action="store_true", help="a FlashInfer RMSNorm before each GEMM (timed with it)")
    parser.add_argument("--verbose", action="store_true", help="tracebacks of failing variants")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    ms = [int(m) for m in args.ms.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model in [c for c in args.configs.split(",") if c]:
        for name, (n, k) in linear_shapes(model, args.tp).items():
            rows += bench_linear(model, name, n, k, ms, args, gen)
    bandwidth = copy_bandwidth()
    variants = args.variants.split(",")
    failures = sorted({f"{v}: {r[f'{v}_fail']}" for r in rows for v in ("bf16", *variants) if f"{v}_fail" in r})
    for failure in failures:
        print("FAILED", failure)
    sums = []
    for config in sorted({r["config"] for r in rows}):
        for m in ms:
            layer = [r for r in rows if r["config"] == config and r["m"] == m]
            total = {"config": config, "m": m}
            for v in ("bf16", *variants):
                times = [r.get(f"{v}_us") for r in layer]
                if times and all(t is not None for t in times):
                    total[f"{v}_us"] = sum(times)
                    if v != "bf16" and "bf16_us" in total:
                        total[f"{v}_x"] = total[f"{v}_us"] / total["bf16_us"]
            sums.append(total)
    write_json(args.out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "copy_bandwidth_bytes_per_s": bandwidth, "gemm": rows, "layer_sums": sums})
    print_table(rows, ["config", "linear", "m", "bf16_us", *[f"{v}_us" for v in variants], "bf16_gbps", "fp8_gbps"])
    print_table(rows, ["linear", "m", "n", "k", "bf16_err", *[f"{v}_err" for v in variants], *[f"{v}_bug" for v in variants]])
    print_table(sums, ["config", "m", "bf16_us", *[f"{v}_x" for v in variants]])
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written)")


if __name__ == "__main__":
    main()
