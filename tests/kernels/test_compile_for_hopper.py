"""Triton kernels compiled for Hopper (sm_90) on this CPU machine: the interpreter runs a
kernel's logic but not the compiler's type rules (a pointer of two element types across the
branches of an ``if`` runs in the interpreter and fails to compile)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


def compile_for_hopper(kernel, types: list[str], constexprs: dict) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(zip(kernel.arg_names, types + ["constexpr"] * len(constexprs)))
    triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
def test_norm_rope_store_compiles(cache):
    from tpserve.kernels.rope_store import _norm_rope_store_kernel

    types = ["*bf16", "*bf16", f"*{cache}", f"*{cache}", "*i64", "*i64", "*fp32", "*bf16", "*bf16", "i32", "fp32"]
    compile_for_hopper(_norm_rope_store_kernel, types, {"NUM_Q_HEADS": 8, "NUM_KV_HEADS": 2, "HEAD_DIM": 128,
                                                        "HAS_NORM": True, "CLAMP": 448.0 if cache != "bf16" else 0.0})
