"""Every Triton kernel launch the interpreter checks make, compiled for Hopper (sm_90) on the CPU.

The interpreter runs a kernel's logic but not the compiler's rules: a pointer of two element
types across the branches of an ``if``, a constexpr used as a tensor, a block shape the backend
rejects all pass there and fail on the GPU. So interpreter_checks.py records each launch's
argument types and constexprs (``record_launches``), and this script, run without
TRITON_INTERPRET, compiles each distinct one with Triton's CUDA backend for sm_90 (no GPU needed; the
variants each is compiled in: ``compile_recorded``).
A kernel with a ``PDL`` constexpr is also compiled as the GPU launches it (programmatic dependent
launch, ``tpserve.kernels.triton_pdl``), which the interpreter cannot run. Every compiled kernel must fit
an SM's shared memory, which the GPU checks only at load time; the grouped MoE GEMM is also compiled at
each of its production tiles (``kernels.moe.tiles_for``: bf16, float32 and FP8 experts) with Qwen3-30B-A3B's
types, which the interpreter checks' small problems do not reach.

    python tests/kernels/hopper_compile.py LAUNCHES.json
"""

from __future__ import annotations

import importlib
import inspect
import json
import multiprocessing
import os
import sys

import torch

TYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
    torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
    torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
}
OPTIONS = ("num_warps", "num_stages", "launch_pdl")
SM90_SHARED_MEMORY = 232448  # bytes a block may use on an H100 / H200 (227 KB)


def _type_of(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def record_launches(path: str) -> None:
    """Append every interpreted kernel launch's types and constexprs to ``path`` (JSON lines)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
        bound = inspect.signature(self.fn).bind(*args, **{k: v for k, v in kwargs.items() if k not in OPTIONS})
        bound.apply_defaults()  # a default argument is compiled too
        signature, constexprs = {}, {}
        for name, value in bound.arguments.items():
            if "constexpr" in str(params[name].annotation) or value is None:
                signature[name] = "constexpr"
                constexprs[name] = value
            else:
                signature[name] = _type_of(value)
        record = {"module": self.fn.__module__, "kernel": self.fn.__name__, "signature": signature,
                  "constexprs": constexprs, "options": options}
        with open(path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


def grouped_gemm_tile_launches() -> list[dict]:
    """The grouped MoE GEMM at every production tile (``tiles_for``): bf16 and float32 experts (a float32
    model's tiles hold fewer stages), and FP8 ones with their float32 block scales (the second GEMM's launch:
    the router weight scales its rows)."""
    from tpserve.kernels.moe import FP8_TILES_BY_ROWS, TILES_BY_ROWS, tiles_for

    launches = []
    for act, fp8, table, k_uniform in (("bf16", False, TILES_BY_ROWS, False), ("fp32", False, TILES_BY_ROWS, False),
                                       ("bf16", True, FP8_TILES_BY_ROWS, True), ("bf16", True, FP8_TILES_BY_ROWS, False)):
        for bound, _ in table:
            tile = tiles_for(bound or 1 << 30, fp8=fp8, itemsize=4 if act == "fp32" else 2)
            signature = {name: "i32" for name in ("num_rows", "N", "K", "stride_am", "stride_we", "stride_wn",
                                                  "stride_cm", "stride_se", "stride_sp", "stride_sn", "part_rows")}
            signature.update(a_ptr=f"*{act}", w_ptr="*fp8e4nv" if fp8 else f"*{act}", c_ptr=f"*{act}",
                             scale_ptr=f"*{act}", sorted_rows_ptr="*i32", block_expert_ptr="*i32",
                             padded_len_ptr="*i32", ws_ptr="*fp32" if fp8 else f"*{act}")
            constexprs = dict(A_ROWS_PER_TOKEN=1, SCALE=True, IEEE=act == "fp32", BLOCK_M=tile.block_m,
                              BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                              BN=128 if fp8 else 1, BK=128 if fp8 else 1, FP8=fp8, SILU=tile.fuse_silu,
                              K_UNIFORM=k_uniform)
            signature.update({name: "constexpr" for name in constexprs})
            launches.append({"module": "tpserve.kernels.moe", "kernel": "_grouped_gemm_kernel", "signature": signature,
                             "constexprs": constexprs, "options": {"num_warps": tile.warps, "num_stages": tile.stages},
                             "aligned_only": True})
    return launches


def _code_paths(launch: dict) -> str:
    """A launch without its integer constexprs (block sizes, padded counts): what picks its code paths (types,
    flags, options), where the integers only size them."""
    flags = {name: value for name, value in launch["constexprs"].items() if not isinstance(value, int)
             or isinstance(value, bool)}
    return json.dumps([launch["module"], launch["kernel"], launch["signature"], flags, launch["options"]],
                      sort_keys=True)


def _one_per_code_path(launches: list[dict]) -> list[dict]:
    return list({_code_paths(launch): launch for launch in launches}.values())


def compile_recorded(path: str) -> int:
    """Every launch with its pointers 16-byte aligned, as torch's allocations are (Triton then specializes: vector
    loads, cp.async pipelining), at each of its sizes; once per code path as launched on arbitrary pointers, and
    once per code path with PDL (its code is the other's plus the launch intrinsics, placed by the flags, not the
    sizes). Cut from every variant of each (860 compiles in 139 s on CI's two cores) to 450 (79 s)."""
    with open(path) as f:
        launches = [json.loads(line) for line in sorted(set(f.read().splitlines()))]
    if any(launch["kernel"] == "_grouped_gemm_kernel" for launch in launches):  # not for another file's kernels
        launches += grouped_gemm_tile_launches()
    jobs = [(launch, True) for launch in launches]
    jobs += [(launch, False) for launch in _one_per_code_path([x for x in launches if not x.get("aligned_only")])]
    jobs += [({**launch, "constexprs": {**launch["constexprs"], "PDL": True},
               "options": {**launch["options"], "launch_pdl": True}}, True)
             for launch in _one_per_code_path([x for x in launches if x["constexprs"].get("PDL") is False])]
    with multiprocessing.get_context("fork").Pool(min(2, os.cpu_count() or 1)) as pool:  # CI's two cores
        for error in pool.imap_unordered(compile_one, jobs):
            if error:
                sys.exit(error)
    return len(jobs)


def compile_one(job: tuple[dict, bool]) -> str | None:
    """Compiles one recorded launch for sm_90: None, or why it does not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch, aligned = job
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, t in launch["signature"].items() if t.startswith("*")} if aligned else {}
    source = ASTSource(fn=kernel, signature=launch["signature"], constexprs=launch["constexprs"], attrs=attrs)
    what = (f"{launch['module']}.{launch['kernel']} (constexprs {launch['constexprs']}, options {launch['options']}, "
            f"aligned pointers: {aligned})")
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    except Exception as e:
        return f"{what} does not compile for sm_90:\n{e}"
    if compiled.metadata.shared > SM90_SHARED_MEMORY:
        return f"{what} needs {compiled.metadata.shared} bytes of shared memory, past sm_90's {SM90_SHARED_MEMORY}"
    return None


if __name__ == "__main__":
    print(f"compiled {compile_recorded(sys.argv[1])} kernel variants for sm_90: ok")
