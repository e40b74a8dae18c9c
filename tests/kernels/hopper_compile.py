"""Every Triton kernel launch the interpreter checks make, compiled for Hopper (sm_90) on the CPU.

The interpreter runs a kernel's logic but not the compiler's rules: a pointer of two element
types across the branches of an ``if``, a constexpr used as a tensor, a block shape the backend
rejects all pass there and fail on the GPU. So interpreter_checks.py records each launch's
argument types and constexprs (``record_launches``), and this script, run without
TRITON_INTERPRET, compiles each distinct one with Triton's CUDA backend for sm_90 (no GPU needed).
A kernel with a ``PDL`` constexpr is also compiled as the GPU launches it (programmatic dependent
launch, ``tpserve.kernels.triton_pdl``), which the interpreter cannot run.

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


def compile_recorded(path: str) -> int:
    with open(path) as f:
        launches = [json.loads(line) for line in sorted(set(f.read().splitlines()))]
    launches += [{**launch, "constexprs": {**launch["constexprs"], "PDL": True},
                  "options": {**launch["options"], "launch_pdl": True}}
                 for launch in launches if launch["constexprs"].get("PDL") is False]
    # Twice each: as launched on arbitrary pointers, and with every pointer 16-byte aligned as torch's
    # allocations are (Triton then specializes: vector loads, cp.async pipelining); two processes (CI's cores).
    jobs = [(launch, aligned) for launch in launches for aligned in (False, True)]
    with multiprocessing.get_context("fork").Pool(min(2, os.cpu_count() or 1)) as pool:
        for error in pool.imap_unordered(compile_one, jobs):
            if error:
                sys.exit(error)
    return len(launches)


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
    try:
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    except Exception as e:
        return (f"{launch['module']}.{launch['kernel']} does not compile for sm_90 "
                f"(constexprs {launch['constexprs']}, aligned pointers: {aligned}):\n{e}")
    return None


if __name__ == "__main__":
    print(f"compiled {compile_recorded(sys.argv[1])} kernel launches for sm_90: ok")
