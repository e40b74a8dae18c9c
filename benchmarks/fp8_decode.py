"""FP8 against bf16: the decode step at batch 1 (and ``--batch-sizes``), one engine per GEMM.

For each model config (random weights, ``load_format="dummy"``) a bf16 engine, then an FP8
engine (``quantization="fp8"``: 128x128 block scales, the published format) per FP8 GEMM in
``--fp8-gemms`` (``TPSERVE_FP8_GEMM``, see ``tpserve.kernels.fp8_linear``), decode with CUDA
graphs, in the same process one after the other; fp8 / bf16 is the issue's target (<= 0.6 at
batch 1). A step is timed synchronously (forward, sampling, host sync: ``step_ms``) and, with
``--pipelined``, as the engine runs it under a Scheduler with overlap scheduling (``pipelined_ms``:
the interval between steps, the inter-token time a user sees). ``--variant`` adds engines built
under other environment settings (a kernel switched off, say), e.g. for Qwen3-30B-A3B without FP8:
``--fp8-gemms "" --variant gemv-off:TPSERVE_BF16_GEMV=0``. ``--fp8-checkpoint DIR`` adds an engine loading DIR's
config.json, which carries a published FP8 ``quantization_config`` (random FP8 weights: the checkpoint path; a MoE model's experts are FP8
there and, since session 45, under ``quantization="fp8"`` too), e.g. ``tests/data/configs/Qwen3-30B-A3B-FP8``.
The GEMMs one by one, against bf16 and for accuracy: ``benchmarks/experiments/fp8_gemm.py``.

    python benchmarks/fp8_decode.py --configs tests/data/configs/Qwen3-8B,tests/data/configs/Qwen3-32B \
        --out out/fp8_decode.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import traceback

import torch
from common import device_name, environment, fill_kv_randomly, make_engine, print_table, setup_logging, write_json
from decode_latency import time_decode, time_pipelined
from tpserve.config import ModelConfig
from tpserve.kernels.fp8_linear import FP8_GEMM_ENV
from tpserve.kernels.gemv import BF16_GEMV_ENV, DEFINES_ENV, PDL_ENV, SILU_MUL_ENV


def decode_engine(model: str, quantization: str | None, max_batch: int, context: int, warmup: int, iters: int,
                  decode_attention: str = "auto"):
    """An engine (random weights) with room for ``max_batch`` sequences of ``context`` cached tokens
    plus the timed steps, its KV cache filled. Prefill chunks no longer than the pipelined timing's
    prompts need: an FP8 engine warms its GEMMs up to that size at start (8192 tokens took 93 s
    on an H200 without a carried cache; docs/results/2026-12-02-h200-session12/call4)."""
    chunk = max(1024, context + iters + warmup + 8)
    # the pipelined timing's requests decode one token a prefill step while the batch's prompts prefill, and each
    # takes whole pages (16 tokens, the default page size, of slack)
    longest = context + iters + warmup + 8 + -(-max_batch * context // chunk) + 16
    engine = make_engine(model, quantization=quantization, max_total_tokens=(max_batch + 2) * longest,
                         cuda_graph_max_bs=max_batch, decode_attention=decode_attention,
                         chunked_prefill_size=chunk, max_running_requests=max(max_batch, 8))
    fill_kv_randomly(engine)
    return engine


def pipelined_ms(engine, batch: int, context: int, warmup: int, iters: int) -> float | None:
    timed = time_pipelined(engine, batch, context, warmup, iters)
    if isinstance(timed, str):
        print(f"pipelined batch {batch}, context {context}: not timed ({timed})", flush=True)
        return None
    return timed[0] * 1e3


def decode_step_ms(model: str, quantization: str | None, batch_sizes: list[int], context: int, warmup: int,
                   iters: int, pipelined: bool, decode_attention: str = "auto") -> dict:
    engine = decode_engine(model, quantization, max(batch_sizes), context, warmup, iters, decode_attention)
    weight_gib = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**30
    steps, piped = {}, {}
    for batch in batch_sizes:
        seconds = time_decode(engine, batch, context, warmup, iters)
        steps[batch] = None if seconds is None else seconds * 1e3
        piped[batch] = pipelined_ms(engine, batch, context, warmup, iters) if pipelined else None
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return {"step_ms": steps, "pipelined_ms": piped, "weight_gib": weight_gib}


def alternating_rounds(model: str, runs: list[tuple[str, str | None, dict]], batch: int, args) -> list[dict]:
    """Every engine of ``runs`` built and held at once, then timed in turn ``args.rounds`` times
    (bf16, fp8, bf16, fp8, ...), so the machine's drift over the run falls on both sides of each
    ratio: each label's median step and the median of its per-round ratios to the first run."""
    engines = {}
    for label, quant, env, *override in runs:
        with environment(env):
            engines[label] = decode_engine(override[0] if override else model, quant, batch, args.context, args.warmup,
                                           args.iters, args.decode_attention)
    times: dict[str, list[float]] = {label: [] for label in engines}
    piped: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(args.rounds):
        for label, engine in engines.items():
            times[label].append(time_decode(engine, batch, args.context, args.warmup, args.iters) * 1e3)
            if args.pipelined:
                piped[label].append(pipelined_ms(engine, batch, args.context, args.warmup, args.iters) or float("nan"))
    base = runs[0][0]
    rows = []
    for label, ms in times.items():
        ratios = [t / b for t, b in zip(ms, times[base])]
        row = {"config": model.rstrip("/").rsplit("/", 1)[-1], "weights": label, "batch": batch,
               "context": args.context, "step_ms": statistics.median(ms), "rounds_ms": ms,
               "over_bf16": None if label == base else statistics.median(ratios),
               "ratio_min": None if label == base else min(ratios), "ratio_max": None if label == base else max(ratios)}
        if args.pipelined:
            piped_ratios = [t / b for t, b in zip(piped[label], piped[base])]
            row |= {"pipelined_ms": statistics.median(piped[label]), "pipelined_rounds_ms": piped[label],
                    "pipelined_over_bf16": None if label == base else statistics.median(piped_ratios)}
        rows.append(row)
    del engines
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="tests/data/configs/Qwen3-8B,tests/data/configs/Qwen3-32B",
                        help="comma-separated directories with a config.json (weights are random)")
    parser.add_argument("--fp8-gemms", default="auto,cuda_triton,triton,flashinfer",
                        help=f"FP8 GEMMs ({FP8_GEMM_ENV}) to run an FP8 engine with, one after the other")
    parser.add_argument("--bf16-cublas", action="store_true",
                        help="also a bf16 engine with TPSERVE_BF16_GEMV=0 (cuBLAS at one or two rows, not the CUDA GEMV)")
    parser.add_argument("--gemv-pdl-off", action="store_true",
                        help=f"also each engine with {PDL_ENV}=0 (the CUDA GEMV launched without programmatic dependent launch)")
    parser.add_argument("--silu-mul-off", action="store_true",
                        help=f"also each engine with {SILU_MUL_ENV}=0 (the dense MLP's SiLU-and-mul as its own kernel)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:ENV=VALUE[,ENV=VALUE]",
                        help="also a bf16 engine built with these environment variables (repeatable)")
    parser.add_argument("--fp8-variant", action="append", default=[], metavar="LABEL:ENV=VALUE[,ENV=VALUE]",
                        help="also an FP8 engine (the first of --fp8-gemms) built with these environment variables, "
                             f"e.g. 'loads16:{DEFINES_ENV}=FP8_LOADS=16' (repeatable)")
    parser.add_argument("--fp8-checkpoint", action="append", default=[], metavar="DIR",
                        help="also an engine of DIR's config.json, an FP8 checkpoint's (random weights), for every config "
                             "(repeatable; past the first, labelled by DIR's name)")
    parser.add_argument("--fp8-checkpoint-variant", action="append", default=[], metavar="LABEL:ENV=VALUE[,ENV=VALUE]",
                        help="also an --fp8-checkpoint engine built with these environment variables (repeatable)")
    parser.add_argument("--pipelined", action="store_true",
                        help="also time each step under a Scheduler with overlap scheduling (the inter-token time)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="above 1: hold every engine at once and time them in turn this many times (one batch size)")
    parser.add_argument("--batch-sizes", default="1", help="decode batch sizes")
    parser.add_argument("--decode-attention", default="auto", help="every engine's --decode-attention")
    parser.add_argument("--context", type=int, default=512, help="cached tokens of each decoding sequence")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    setup_logging()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for model in [c for c in args.configs.split(",") if c]:
        name = model.rstrip("/").rsplit("/", 1)[-1]
        # (label, quantization, environment): the first engine, as users get it, is the base of every ratio
        # the first engine: the checkpoint as it is (bf16, or FP8 where config.json carries a quantization_config)
        first = "fp8 ckpt" if ModelConfig.from_pretrained(model).quantization is not None else "bf16"
        runs = [(first, None, {})] + [(f"fp8 {g}", "fp8", {FP8_GEMM_ENV: g}) for g in args.fp8_gemms.split(",") if g]
        if args.gemv_pdl_off:
            runs += [(f"{label} nopdl", quant, env | {PDL_ENV: "0"}) for label, quant, env in runs]
        if args.bf16_cublas:
            runs.insert(1, ("bf16 cublas", None, {BF16_GEMV_ENV: "0"}))
        if args.silu_mul_off:
            runs += [(f"{label} silu-off", quant, env | {SILU_MUL_ENV: "0"}) for label, quant, env in runs]
        for variant in args.variant:
            label, _, settings = variant.partition(":")
            runs.append((label, None, dict(kv.split("=", 1) for kv in settings.split(",") if kv)))
        first_gemm = args.fp8_gemms.split(",")[0] or "auto"
        for variant in args.fp8_variant:
            label, _, settings = variant.partition(":")
            env = {FP8_GEMM_ENV: first_gemm} | dict(kv.split("=", 1) for kv in settings.split(",") if kv)
            runs.append((f"fp8 {label}", "fp8", env))
        for i, checkpoint in enumerate(args.fp8_checkpoint):
            ckpt = "fp8 ckpt" if i == 0 else f"ckpt {checkpoint.rstrip('/').rsplit('/', 1)[-1]}"
            runs.append((ckpt, None, {}, checkpoint))
            for variant in args.fp8_checkpoint_variant:
                label, _, settings = variant.partition(":")
                runs.append((f"{ckpt} {label}", None, dict(kv.split("=", 1) for kv in settings.split(",") if kv),
                             checkpoint))
        if args.rounds > 1:
            rows += alternating_rounds(model, runs, batches[0], args)
            continue
        base: dict[int, float] = {}
        base_piped: dict[int, float | None] = {}
        for label, quant, env, *override in runs:
            try:
                with environment(env):
                    result = decode_step_ms(override[0] if override else model, quant, batches, args.context,
                                            args.warmup, args.iters, args.pipelined, args.decode_attention)
            except Exception as e:  # noqa: BLE001 -- reported, the other GEMMs still run
                traceback.print_exc()
                rows.append({"config": name, "weights": label, "failed": f"{type(e).__name__}: {e}"[:200]})
                continue
            for batch, ms in result["step_ms"].items():
                piped = result["pipelined_ms"][batch]
                if label == first and ms is not None:
                    base[batch] = ms
                    base_piped[batch] = piped
                row = {"config": name, "weights": label, "batch": batch, "context": args.context, "step_ms": ms,
                       "pipelined_ms": piped, "weight_gib": result["weight_gib"]}
                if label != first and ms is not None and batch in base:
                    row["over_bf16"] = ms / base[batch]
                    if piped is not None and base_piped.get(batch):
                        row["pipelined_over_bf16"] = piped / base_piped[batch]
                rows.append(row)
    for row in rows:
        if "failed" in row:
            print(f"FAILED {row['config']} {row['weights']}: {row['failed']}")
    print_table([r for r in rows if "failed" not in r],
                ["config", "weights", "batch", "context", "step_ms", "over_bf16", "ratio_min", "ratio_max",
                 "pipelined_ms", "pipelined_over_bf16", "weight_gib"])
    write_json(args.out, {"device": device_name(), "torch": torch.__version__, "decode": rows})


if __name__ == "__main__":
    main()
