"""benchmarks/experiments/small_m_gemm_kernel.py's small_m_linear (an experiment the engine does not use:
cuBLAS measured as fast at the served shapes) against F.linear in float32, on the CPU through Triton's interpreter.

The checks run in one child process with TRITON_INTERPRET=1 (Triton reads it when a kernel is
defined, so it cannot be switched on inside a process that may already hold compiled kernels):
the parent runs this file as a script once and reports every case as its own test. Skipped
where triton is missing.

Three things of the interpreter, not of the kernel, shape the tolerances and set-up: its float32
-> bfloat16 cast truncates (up to 2**-7 relative, where the GPU rounds to nearest); its tl.dot
would multiply bfloat16 tiles as raw bits, so under the interpreter the kernel hands bfloat16
tiles to tl.dot as float32 (the float16 cases run the 16-bit tl.dot); and with a recent numpy
(2.4 here) its ``range`` over a runtime bound fails (``int()`` of a one-element array): the child
patches that one conversion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# name -> (M, N, K, bias, dtype, config as SmallMConfig keywords or None for default_config).
# Leading dims, strides, M = 0 and the argument checks are separate checks below.
CASES: dict[str, tuple] = {
    "default-m1-bias": (1, 96, 256, True, "bfloat16", None),
    "default-splitk-bias": (3, 64, 2048, True, "float16", None),  # 4 N tiles -> split 2
    "dot_t-ragged-n-and-k-split3": (
        5,
        100,
        272,
        True,
        "bfloat16",
        {"variant": "dot_t", "block_n": 32, "block_k": 64, "split_k": 3},
    ),
    "dot_t-m33-split4": (
        33,
        130,
        512,
        True,
        "bfloat16",
        {"variant": "dot_t", "block_n": 64, "block_k": 128, "split_k": 4},
    ),
    "dot-m17": (
        17,
        40,
        96,
        True,
        "float16",
        {"variant": "dot", "block_n": 16, "block_k": 32},
    ),
    "dot-m64-split2": (
        64,
        80,
        256,
        False,
        "bfloat16",
        {"variant": "dot", "block_n": 32, "block_k": 64, "split_k": 2},
    ),
    "fma-m1": (
        1,
        50,
        160,
        True,
        "bfloat16",
        {"variant": "fma", "block_n": 8, "block_k": 64},
    ),
    "fma-m6-split4": (
        6,
        48,
        128,
        False,
        "float16",
        {"variant": "fma", "block_n": 16, "block_k": 32, "split_k": 4},
    ),
    "fma-m16-split2": (
        16,
        20,
        384,
        True,
        "bfloat16",
        {"variant": "fma", "block_n": 4, "block_k": 128, "split_k": 2},
    ),
}
CHECKS = (
    "leading-dims",
    "strided-x-and-weight",
    "empty",
    "deterministic",
    "rejects",
    "default-config",
)
TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3}  # max |y - ref| / max |ref|


# --- child process (TRITON_INTERPRET=1) ------------------------------------------------------


def _patch_interpreter_loop_bounds() -> None:
    """Recent numpy refuses int() of a one-element 1-d array, which the interpreter's
    ``Tensor.__index__`` does for a loop bound; take the element instead."""
    import numpy as np

    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(
            tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0])
        )

    interpreter._patch_lang_tensor = patched


def _relative_error(y, ref) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _run_case(
    m: int, n: int, k: int, bias: bool, dtype: str, config: dict | None
) -> None:
    import torch
    import torch.nn.functional as F
    from small_m_gemm_kernel import SmallMConfig, small_m_linear

    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    dt = getattr(torch, dtype)
    x = torch.randn(m, k, generator=gen).to(dt)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dt)
    b = torch.randn(n, generator=gen).to(dt) if bias else None
    cfg = SmallMConfig(**config) if config is not None else None
    y = small_m_linear(x, w, b, cfg)
    ref = F.linear(x.float(), w.float(), b.float() if bias else None)
    assert y.shape == (m, n) and y.dtype == dt, (y.shape, y.dtype)
    err = _relative_error(y, ref)
    assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]}"


def _run_check(name: str) -> None:
    import torch
    import torch.nn.functional as F
    from small_m_gemm_kernel import (
        MAX_M,
        SmallMConfig,
        auto_split_k,
        default_config,
        small_m_linear,
    )

    gen = torch.Generator().manual_seed(7)
    bf16 = torch.bfloat16
    if name == "leading-dims":
        x = torch.randn(2, 3, 64, generator=gen).to(bf16)
        w = torch.randn(48, 64, generator=gen).to(bf16)
        y = small_m_linear(x, w)
        assert y.shape == (2, 3, 48)
        assert (
            _relative_error(y, F.linear(x.float(), w.float())) <= TOLERANCE["bfloat16"]
        )
        y1 = small_m_linear(x[0, 0], w)  # a 1-d x, as F.linear takes it
        assert y1.shape == (48,)
    elif name == "strided-x-and-weight":
        # Rows of x and of W start every K + 32 elements (views into wider tensors).
        x = torch.randn(4, 160, generator=gen).to(bf16)[:, 16:144]
        w = torch.randn(72, 160, generator=gen).to(bf16)[:, :128]
        assert x.stride(0) == 160 and w.stride(0) == 160
        for config in (
            None,
            SmallMConfig(variant="fma", block_n=8, block_k=32, split_k=2),
        ):
            y = small_m_linear(x, w, config=config)
            assert (
                _relative_error(y, F.linear(x.float(), w.float()))
                <= TOLERANCE["bfloat16"]
            )
    elif name == "empty":
        w = torch.randn(48, 64, generator=gen).to(bf16)
        assert small_m_linear(torch.empty(0, 64, dtype=bf16), w).shape == (0, 48)
    elif name == "deterministic":
        x = torch.randn(7, 512, generator=gen).to(bf16)
        w = torch.randn(40, 512, generator=gen).to(bf16)
        cfg = SmallMConfig(variant="dot_t", block_n=16, block_k=64, split_k=4)
        assert torch.equal(
            small_m_linear(x, w, config=cfg), small_m_linear(x, w, config=cfg)
        )
    elif name == "rejects":
        w = torch.randn(32, 64, generator=gen).to(bf16)
        x = torch.randn(1, 64, generator=gen).to(bf16)
        bad = {  # what -> (call, a word the message must hold)
            "K % 16": (lambda: small_m_linear(x[:, :40], w[:, :40].contiguous()), "16"),
            "K = 0": (lambda: small_m_linear(x[:, :0], w[:, :0].contiguous()), "16"),
            "M > MAX_M": (lambda: small_m_linear(x.expand(MAX_M + 1, 64), w), "rows"),
            "float32": (lambda: small_m_linear(x.float(), w.float()), "float16"),
            "mixed dtypes": (lambda: small_m_linear(x.half(), w), "float16"),
            "K mismatch": (lambda: small_m_linear(x[:, :48], w), "match"),
            "W^T": (lambda: small_m_linear(x, w.t().contiguous().t()), "row-major"),
            "bias shape": (lambda: small_m_linear(x, w, w[0, :31]), "bias"),
            "block_n": (
                lambda: small_m_linear(x, w, config=SmallMConfig(block_n=24)),
                "power of 2",
            ),
            "variant": (
                lambda: small_m_linear(x, w, config=SmallMConfig(variant="mma")),
                "variant",
            ),
            "dot n8": (
                lambda: small_m_linear(
                    x, w, config=SmallMConfig(variant="dot", block_n=8)
                ),
                "16",
            ),
        }
        for what, (call, word) in bad.items():
            try:
                call()
            except ValueError as exc:
                assert word in str(exc), f"{what}: {exc}"
                continue
            raise AssertionError(f"{what}: no ValueError")
    elif name == "default-config":
        # Qwen3-8B's linears on 132 SMs: every config is valid, splits K evenly and only when
        # the N tiles alone leave SMs idle.
        for n, k in (
            (6144, 4096),
            (4096, 4096),
            (24576, 4096),
            (4096, 12288),
            (151936, 4096),
            (1024, 2048),
        ):
            for m in (1, 2, 4, 8, 16, 32, 64):
                cfg = default_config(m, n, k, 132)
                cfg.validate()
                tiles = -(-n // cfg.block_n)
                steps = -(-k // cfg.block_k)
                assert steps % cfg.split_k == 0, (m, n, k, cfg)
                assert cfg.split_k == 1 or tiles < 132, (m, n, k, cfg)
                assert cfg.block_n >= min(64, cfg.block_m(m)), (m, n, k, cfg)
        assert (
            default_config(1, 1024, 2048, 132).split_k > 1
        )  # 64 tiles of 16 on 132 SMs
        assert auto_split_k(1024, 3072, 16, 256, 132) == 3  # 12 steps: 3 splits of 4
    else:
        raise KeyError(name)


def _child_main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    import torch

    torch.set_num_threads(2)
    _patch_interpreter_loop_bounds()
    results = {}
    jobs = [(name, _run_case, args) for name, args in CASES.items()]
    jobs += [(name, _run_check, (name,)) for name in CHECKS]
    for name, fn, args in jobs:
        try:
            fn(*args)
            results[name] = "ok"
        except Exception as exc:  # noqa: BLE001 -- reported per case by the parent
            results[name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(results))


# --- pytest (parent process) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, __file__],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [*CASES, *CHECKS])
def test_small_m_linear(interpreter_results: dict[str, str], name: str) -> None:
    assert interpreter_results[name] == "ok", interpreter_results[name]


if __name__ == "__main__":
    _child_main()
