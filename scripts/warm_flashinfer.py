"""Compile (JIT) the FlashInfer kernels tpserve uses, in parallel processes, before anything
else needs them: CUDA-core decode, tensor-core decode (FlashInfer's fa2 prefill module) and
paged prefill (fa3 on Hopper). Each is built for the given head_dim and dtype. Also the fused
all-reduce + add + RMSNorm kernel of ``--all-reduce fused`` (tpserve's own, built through
FlashInfer's JIT; it needs one GPU to build, two to run), tpserve's CUDA GEMV (``kernels.gemv``) and
FlashInfer's block-scaled FP8 GEMM (Hopper).

    python scripts/warm_flashinfer.py --head-dim 128 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

PARTS = ("decode", "decode_tensor_cores", "prefill", "norm", "silu", "allreduce_fused", "gemv", "fp8_gemm")


def warm_elementwise(part: str, dtype: torch.dtype) -> None:
    """The fused-kernel modules (RMSNorm and add+RMSNorm share one; SiLU-and-mul another)."""
    from tpserve.kernels import flashinfer_ops

    x = torch.randn(4, 256, dtype=dtype, device="cuda")
    if part == "norm":
        flashinfer_ops.rms_norm(x, torch.ones(256, dtype=dtype, device="cuda"), 1e-6)
    else:
        flashinfer_ops.silu_and_mul(x)
    torch.cuda.synchronize()


def warm(part: str, head_dim: int, dtype: torch.dtype) -> None:
    if part in ("norm", "silu"):
        return warm_elementwise(part, dtype)
    if part == "allreduce_fused":
        from tpserve.distributed.fused_allreduce import load_module

        load_module()
        return None
    if part == "fp8_gemm":  # FlashInfer's sm90 block-scaled FP8 GEMM (loads a carried build, or builds it)
        from tpserve.kernels.fp8_linear import flashinfer_runs

        if not flashinfer_runs(0):
            raise RuntimeError("FlashInfer's FP8 GEMM does not run")
        return None
    if part == "gemv":
        from tpserve.kernels.gemv import load_module

        load_module()
        return None
    from tpserve.attention.flashinfer_backend import FlashInferAttentionBackend
    from tpserve.engine.batch import build_forward_inputs
    from tpserve.forward import SequenceInput
    from tpserve.kvcache.pool import KVCachePool

    device = torch.device("cuda")
    heads, kv_heads = 8, 2
    pool = KVCachePool(1, 8, 16, kv_heads, head_dim, dtype, device)
    backend = FlashInferAttentionBackend(
        pool, heads, kv_heads, head_dim, device, decode_tensor_cores=part == "decode_tensor_cores"
    )
    new_tokens = 20 if part == "prefill" else 1
    seqs = [SequenceInput([1] * new_tokens, 3, [1, 2])]
    meta = backend.prepare(seqs, device)
    inputs = build_forward_inputs(seqs, 16, device, meta)
    q = torch.randn(new_tokens, heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(new_tokens, kv_heads, head_dim, dtype=dtype, device=device)
    out = backend.forward(0, q, k, k.clone(), inputs.out_slots, meta)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), f"{part}: non-finite attention output"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--part", choices=PARTS, default=None, help="warm one part in this process")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to warm, each in a process of its own (default: all of {PARTS})")
    args = parser.parse_args()
    if args.part is not None:
        warm(args.part, args.head_dim, getattr(torch, args.dtype))
        return
    start = time.perf_counter()
    procs = {
        part: subprocess.Popen(
            [sys.executable, __file__, "--part", part, "--head-dim", str(args.head_dim), "--dtype", args.dtype]
        )
        for part in args.parts.split(",")
    }
    failed = [part for part, proc in procs.items() if proc.wait() != 0]
    print(f"flashinfer kernels warmed in {time.perf_counter() - start:.0f} s; failed: {failed or 'none'}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
