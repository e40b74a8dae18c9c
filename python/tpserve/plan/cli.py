"""``python -m tpserve plan``: the planner's command line."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import replace
from typing import Any, Callable

from tpserve.config import ModelConfig
from tpserve.engine_config import CHOICES
from tpserve.launch.argtypes import HelpFormatter, OneLineParser, fraction, int_at_least, json_object_arg, number
from tpserve.launch.args import ModelNotFound, dtype_arg, resolve_model_dir
from tpserve.plan.cost import DTYPE_BYTES, GIB, GPUS, GPUSpec, Link, ModelShape
from tpserve.plan.splits import Machine, Settings, plan_splits, render
from tpserve.quant.config import QUANTIZATION_CHOICES, resolve_quantization

CUSTOM_REQUIRED = ("memory_gib", "bandwidth_tbps", "tflops")
DEFAULT_CONTEXT = 32768  # --context when not given, unless the model's context is shorter


class PlanError(ValueError):
    """A bad value, reported in one line."""


# Bounds on the machine's figures: far past any machine, yet small enough that the plan's arithmetic stays finite
# (1e308 GiB overflowed to NaN) and its loop over TP sizes, one per GPU of the whole machine, short (10**9 GPUs hung).
MAX_GPUS_PER_NODE = 1024
MAX_NODES = 1024


def _between(kind: type, low: float, high: float) -> Callable[[str], Any]:
    return number(kind, lambda v: low <= v <= high, f"in [{low:g}, {high:g}]")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="tpserve plan",
        allow_abbrev=False,
        description="Predict, for every tensor-parallel x data-parallel split of a machine, whether the "
        "model fits, its KV capacity, decode latency and throughput, prefill time and all-reduce share; "
        "recommend a split for latency and one for throughput.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", required=True, help="local model directory, or a Hugging Face id in the local cache")
    p.add_argument("--hf-overrides", type=json_object_arg, default=None, metavar="JSON",
                   help="config.json keys to replace, as the server's flag (e.g. a longer max_position_embeddings)")
    p.add_argument("--gpus", type=_between(int, 1, MAX_GPUS_PER_NODE), default=1, help="GPUs per node (ranks, with --gpu cpu)")
    p.add_argument("--nodes", type=_between(int, 1, MAX_NODES), default=1,
                   help="nodes (DP spans them; a TP group may take whole nodes)")
    p.add_argument("--gpu", choices=[*GPUS, "custom"], default="h200",
                   help="device kind from the table; custom: give --memory-gib, --bandwidth-tbps and --tflops")
    p.add_argument("--context", type=int_at_least(2), default=None,
                   help=f"tokens per request (prompt + completion); default: {DEFAULT_CONTEXT}, or the model's "
                   "context length if shorter")
    p.add_argument("--workload", choices=["chat", "batch"], default="chat",
                   help="chat: latency recommendation first; batch: throughput first")
    p.add_argument("--dtype", type=dtype_arg, default="auto",
                   help="serving dtype: auto (the checkpoint's on GPU, float32 on cpu, as the engine), float32, "
                   "bfloat16, float16 (also spelled half, float, bf16)")
    p.add_argument("--quantization", choices=list(QUANTIZATION_CHOICES), default=None,
                   help="the engine's --quantization: FP8 weights for an unquantized checkpoint (an FP8 checkpoint's "
                   "quantization_config counts without it)")
    p.add_argument("--kv-cache-dtype", choices=CHOICES["kv_cache_dtype"], default="auto",
                   help="the engine's --kv-cache-dtype: fp8_e4m3 stores 1 byte per element (twice the tokens; "
                   "decode reads half the KV bytes on Hopper, where XQA reads them)")
    p.add_argument("--mem-fraction", "--gpu-memory-utilization", "--mem-fraction-static", dest="mem_fraction",
                   type=fraction, default=0.85, help="the engine's --mem-fraction")
    p.add_argument("--max-running-requests", type=int_at_least(1), default=256,
                   help="the engine's --max-running-requests (caps the max batch)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (copy bandwidth, matmul rate, TP-2 all-reduce) instead of the "
                   "table: its GPUs, or its CPU with --gpu cpu or without CUDA")
    spec = p.add_argument_group("device figures (override the table or the calibration)")
    spec.add_argument("--memory-gib", type=_between(float, 0.001, 1e6), default=None, help="device memory in GiB")
    spec.add_argument("--bandwidth-tbps", type=_between(float, 0.001, 1e4), default=None,
                      help="device copy bandwidth, bytes read + written")
    spec.add_argument("--tflops", type=_between(float, 0.001, 1e7), default=None,
                      help="achievable dense matmul TFLOP/s in the serving dtype")
    spec.add_argument("--allreduce-us", type=_between(float, 0.0, 1e7), default=None, help="all-reduce latency (alpha)")
    spec.add_argument("--busbw-gbps", type=_between(float, 0.001, 1e7), default=None,
                      help="all-reduce bus bandwidth within a node")
    return p


def _gpu_spec(args: argparse.Namespace) -> tuple[GPUSpec, str]:
    if args.calibrate:
        from tpserve.plan.calibrate import calibrate

        device = "cpu" if args.gpu == "cpu" else None  # None: this machine's GPUs, else its CPU
        print("calibrating: copy bandwidth, matmul rate, TP-2 all-reduce ...", file=sys.stderr, flush=True)
        spec, source = calibrate(device).as_spec(), "calibrated"
    elif args.gpu == "custom":
        missing = [f"--{name.replace('_', '-')}" for name in CUSTOM_REQUIRED if getattr(args, name) is None]
        if missing:
            raise PlanError(f"--gpu custom needs {', '.join(missing)}")
        spec, source = replace(GPUS["h100"], name="custom"), "custom"
    else:
        spec, source = GPUS[args.gpu], "table"

    def given(value: float | None, scale: float, default: float) -> float:
        return default if value is None else value * scale

    link = Link(given(args.allreduce_us, 1e-6, spec.link.alpha_s), given(args.busbw_gbps, 1e9, spec.link.bus_bandwidth))
    spec = replace(
        spec,
        memory_bytes=given(args.memory_gib, GIB, spec.memory_bytes),
        copy_bandwidth=given(args.bandwidth_tbps, 1e12, spec.copy_bandwidth),
        matmul_flops=given(args.tflops, 1e12, spec.matmul_flops),
        link=link,
    )
    return spec, source


def _model_config(model: str, overrides: dict | None = None) -> ModelConfig:
    try:
        model_dir = resolve_model_dir(model)
    except ModelNotFound as e:
        raise PlanError(f"--model: {e}") from None
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise PlanError(f"--model {model}: {model_dir} has no config.json")
    try:
        return ModelConfig.from_pretrained(model_dir, overrides)
    except (ValueError, OSError) as e:
        raise PlanError(f"--model {model}: {e}") from None


def _model_shape(args: argparse.Namespace, config: ModelConfig, device: str) -> ModelShape:
    """The model as the engine serves it on ``device``; the CPU engine dequantizes FP8 weights at load."""
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else config.torch_dtype
    try:
        quant = resolve_quantization(args.quantization, config.quantization)
    except ValueError as e:
        raise PlanError(f"--quantization: {e}") from None
    fp8_block = None if quant is None or device == "cpu" else quant.block_size
    kv_dtype_bytes = 1 if args.kv_cache_dtype == "fp8_e4m3" else None
    fp8_experts = fp8_block is not None  # an FP8 checkpoint's, or quantized at load
    return ModelShape(config, DTYPE_BYTES.get(dtype, 2), fp8_block, kv_dtype_bytes=kv_dtype_bytes, fp8_experts=fp8_experts,
                      fp8_row_scales=fp8_experts and quant.row_scales)


def run(argv: list[str]) -> str:
    """The report for ``argv``; raises PlanError on a bad value."""
    args = build_parser().parse_args(argv)
    config = _model_config(args.model, args.hf_overrides)
    if args.context is None:
        args.context = min(DEFAULT_CONTEXT, config.context_length)
    elif args.context > config.context_length:
        raise PlanError(f"--context {args.context} exceeds the model's context length {config.context_length}")
    gpu, source = _gpu_spec(args)
    shape = _model_shape(args, config, gpu.device)
    if gpu.device == "cpu":  # CPU ranks share the host's memory
        gpu = replace(gpu, memory_bytes=gpu.memory_bytes / args.gpus)
    machine = Machine(gpu, args.gpus, args.nodes)
    settings = Settings(args.context, mem_fraction=args.mem_fraction, max_running_requests=args.max_running_requests,
                        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype)
    plans, excluded = plan_splits(shape, machine, settings)
    # the printed commands serve the config planned for: the overrides ride with the model
    model = args.model if args.hf_overrides is None else f"{args.model} --hf-overrides {shlex.quote(json.dumps(args.hf_overrides))}"
    return render(shape, model, machine, settings, plans, excluded, args.workload, source)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        print(run(argv))
    except SystemExit as e:  # argparse: --help, or a bad value already reported in one line
        return e.code if isinstance(e.code, int) else 2
    except PlanError as e:
        print(f"tpserve plan: error: {e}", file=sys.stderr)
        return 2
    return 0
