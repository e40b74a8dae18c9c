"""fp8_gemv compiled for sm_90 on the CPU (no GPU): registers, spills and the instruction mix of
each default config at a model's shapes, from Triton's CUDA backend and the ``cuobjdump`` /
``nvdisasm`` it ships. A loop that reads the weights at the bandwidth has ~8 instructions a byte
per SM to spend; shuffles (SHFL), shared-memory traffic (LDS/STS) and barriers (BAR) in it are
layout conversions and reductions that eat that budget.

    python benchmarks/experiments/fp8_gemv_sass.py --configs tests/data/configs/Qwen3-8B --ms 1,4
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from fp8_gemm import linear_shapes
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tpserve.kernels.fp8_gemv import GemvConfig, _gemv_kernel, default_config

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
KINDS = ("LDG", "LDS", "STS", "BAR", "SHFL", "F2FP", "HADD2", "FFMA", "FADD", "FMUL", "MUFU", "HMMA", "PRMT")


def compile_sm90(config: GemvConfig, m: int, n: int, k: int, gated: bool) -> bytes:
    names = _gemv_kernel.arg_names
    ints = ("M", "N", "K", "stride_xm", "stride_s", "stride_split", "split_len", "n_blocks")
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16" if config.split_k == 1 else "*fp32",
                 **dict.fromkeys(ints, "i32")}
    constexprs = dict(GROUP_N=128, GROUP_K=128, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                      DOT=config.variant == "dot_t", GATED=gated, PREFETCH=config.prefetch, PDL=config.pdl,
                      EVEN_N=n % config.block_n == 0, EVEN_K=k % config.block_k == 0, IEEE=False, INTERPRETED=False)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    # what the launcher specialises: 16-byte aligned pointers, sizes and strides divisible by 16
    aligned = ["x_ptr", "w_ptr", "s_ptr", "out_ptr", "N", "K", "stride_xm", "stride_split", "split_len", "n_blocks"]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    compiled = triton.compile(ASTSource(fn=_gemv_kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    return compiled.asm["cubin"]


def inspect_cubin(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    ops = Counter(op.split(".")[0] for op in re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M))
    row = {key.lower(): int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK", "SHARED")}
    return {**row, **{kind: ops.get(kind, 0) for kind in KINDS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="tests/data/configs/Qwen3-8B", help="comma-separated config directories")
    parser.add_argument("--ms", default="1,4", help="token counts")
    parser.add_argument("--sm-count", type=int, default=132)
    args = parser.parse_args()
    for model in [c for c in args.configs.split(",") if c]:
        for name, (n, k) in linear_shapes(model).items():
            for m in [int(v) for v in args.ms.split(",")]:
                config = default_config(m, n, k, 128, args.sm_count)
                row = inspect_cubin(compile_sm90(config, m, n, k, gated=name == "down"))
                print(f"{model.rstrip('/').rsplit('/', 1)[-1]} {name} m={m} {config}\n    {row}", flush=True)


if __name__ == "__main__":
    main()
