"""The CUDA small-M GEMV (``csrc/gemv.cu``): y = x @ W.T for 1..``MAX_TOKENS`` bf16 tokens, W bf16
or e4m3 with float32 scales per 128x128 block (or, ``row_scales``, one token, one per row); float32 sums, bf16
out, the same bits every run.
Few-token decode is bound by reading W, which it only streams (16-byte loads, several in flight).
Built on first use by FlashInfer's JIT (cached). bf16 layers (also LM head, MoE router) take it
via ``linear``/``bf16_gemv_enabled``; FP8 layers via ``kernels.fp8_linear``. With ``silu_mul`` a
merged [gate; up] weight gives SiLU(gate) * up directly (a dense MLP's SwiGLU without its own kernel);
with ``norm`` x is RMS-normed first and with ``add_to`` the product is added to a residual stream in
place (1 or 2 tokens; the layers fuse at 1): the decoder's residual add + RMSNorm without a kernel of its own.
``experts``: the same kernel over a MoE layer's top-k experts at one token, routed from the router's logits (FP8
experts in 128x128 blocks or, since session 45, with a scale a row: Qwen3-30B-A3B-FP8-dynamic's batch-1 step 1.25x
bf16's in the Triton expert kernels, 0.82x here; H100).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from tpserve.kernels import jit_name
from tpserve.kernels.settings import int_settings
from tpserve.kernels.pdl import pdl_supported
from tpserve.quant.fp8 import ExpertScales

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "gemv.cu"
MAX_TOKENS = 8
SILU_MUL_MAX_TOKENS = 2  # the SwiGLU epilogue: the rows at which a dense MLP takes the GEMV
FUSED_MAX_TOKENS = 2  # ``norm`` and ``add_to``: batch-1 and -2 decode
# Where the layers take that fusion: one token. At two, Qwen3-8B bf16's pipelined step was 1.046x the one with the
# add + RMSNorm as kernels of their own (4.614 vs 4.410 ms; Qwen3-30B-A3B 1.004x: docs/benchmarks.md, session 19).
FUSE_NORM_MAX_TOKENS = 1
ROW_SCALES_MAX_TOKENS = 1  # weights scaled per row (compressed-tensors): one token, where the layers take the GEMV
SCALE_BLOCK = 128
BF16_GEMV_ENV = "TPSERVE_BF16_GEMV"
# Programmatic dependent launch on Hopper and newer (see csrc/gemv.cu): ``0`` turns it off.
PDL_ENV = "TPSERVE_GEMV_PDL"
# Rows up to which a bf16 layer takes the GEMV. H200 (fp8_gemm.py, docs/benchmarks.md), a decoder
# layer's four GEMMs vs cuBLAS, Qwen3-8B / 32B: 0.87x / 0.80x at 1 row, 0.97x / 0.88x at 2, 1.12x (8B)
# at 4; whole decode steps at batch 1: Qwen3-8B 0.97x, Qwen3-32B 0.87x, Qwen3-30B-A3B 0.93x.
BF16_GEMV_TOKENS = 2
# ``0``: the dense MLP runs SiLU-and-mul as its own kernel after the GEMV (read at load).
SILU_MUL_ENV = "TPSERVE_GEMV_SILU_MUL"
# ``0``: the decoder's residual add + RMSNorm runs as a kernel of its own, not in the GEMVs around it
# (read at each forward, so a CUDA graph keeps what its capture saw). Fused, Qwen3-8B batch 1 took 1.3% off
# the FP8 step and 0.3% off bf16 (session 16); tests/gpu/test_gemv.py (bits equal under PDL, no further
# from float32 than the separate kernels) and test_moe.py pass with it (session 17).
FUSE_NORM_ENV = "TPSERVE_GEMV_FUSE_NORM"
# Experiments: a variant of the kernel's constants, e.g. ``FP8_LOADS=16 FP8_ROWS=8`` (csrc/gemv.cu's
# TPSERVE_GEMV_* macros), built as a module of its own. Read at each call, so a CUDA graph keeps the
# variant its capture saw and engines of several variants can be timed in one process.
DEFINES_ENV = "TPSERVE_GEMV_DEFINES"
_VEC_BYTES = 16  # the kernel's loads: weight rows and pointers must be multiples


def jit_spec(defines: tuple[tuple[str, int], ...] = ()) -> Any:
    """FlashInfer's JIT spec; ``defines`` (experiments) override ``TPSERVE_GEMV_*``, in a module of their own."""
    from flashinfer.jit.core import current_compilation_context, gen_jit_spec

    # sm_8x too: FP8 layers on sm89 (L40S, RTX 4090) take it at one token; it compiles for sm_80 and sm_89.
    flags = current_compilation_context.get_nvcc_flags_list(supported_major_versions=[8, 9, 10, 12])
    flags += [f"-DTPSERVE_GEMV_{name}={value}" for name, value in defines]
    name = jit_name("tpserve_gemv", SOURCE) + "".join(f"_{name.lower()}{value}" for name, value in defines)
    return gen_jit_spec(name, [SOURCE], extra_cuda_cflags=flags)


@functools.cache
def load_module(defines: tuple[tuple[str, int], ...] = ()) -> Any:
    """Compile (first time; cached under FlashInfer's JIT directory) and load the kernels."""
    return jit_spec(defines).build_and_load()


@functools.cache
def _defines(setting: str) -> tuple[tuple[str, int], ...]:
    return int_settings(setting, DEFINES_ENV)


def unsupported(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None = None, silu_mul: bool = False,
    fused: bool = False, row_scales: bool = False,
) -> str | None:
    """Why ``gemv(x, weight, scale_inv, silu_mul=silu_mul, row_scales=row_scales)`` cannot run (``fused``: with
    ``norm`` or ``add_to``), or None when it can."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    fp8 = scale_inv is not None
    if x.dtype != torch.bfloat16 or weight.dtype != (torch.float8_e4m3fn if fp8 else torch.bfloat16):
        return f"x must be bf16 and weight {'float8_e4m3fn' if fp8 else 'bf16'}, got {x.dtype} and {weight.dtype}"
    max_m = (ROW_SCALES_MAX_TOKENS if row_scales else FUSED_MAX_TOKENS if fused
             else SILU_MUL_MAX_TOKENS if silu_mul else MAX_TOKENS)
    if not 1 <= m <= max_m:
        return f"{m} rows of x, the kernel takes 1 to {max_m}{' fused with a norm or add' if fused else ''}"
    if weight.dim() != 2 or not weight.is_contiguous() or weight.shape[1] != x.shape[-1] or weight.shape[0] == 0:
        return f"weight must be a contiguous [N, K] with K = {x.shape[-1]}, got {tuple(weight.shape)}"
    n, k = weight.shape
    if silu_mul and n % 8:
        return f"SiLU-and-mul needs the merged gate/up rows ({n}) in a multiple of 8"
    if (k * weight.element_size()) % _VEC_BYTES or weight.data_ptr() % _VEC_BYTES:
        return f"K ({k}) must be a multiple of {_VEC_BYTES // weight.element_size()} and the weight 16-byte aligned"
    if row_scales and not fp8:
        return "a scale per row needs FP8 weights and their scale_inv"
    if fp8:
        blocks = (n, 1) if row_scales else (-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK))
        what = "a row's scale" if row_scales else "128x128 blocks"
        if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != blocks or not scale_inv.is_contiguous():
            return f"scale_inv must be contiguous float32 {list(blocks)} ({what}), got {scale_inv.dtype} {list(scale_inv.shape)}"
    if x.device.type != "cuda" or weight.device != x.device or (fp8 and scale_inv.device != x.device):
        return "x, weight and scale_inv must be on one CUDA device"
    return None


def supported(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None = None, silu_mul: bool = False,
    fused: bool = False, row_scales: bool = False,
) -> bool:
    return unsupported(x, weight, scale_inv, silu_mul, fused, row_scales) is None


def _check_fusion(x2: torch.Tensor, n_out: int, norm: tuple[torch.Tensor, float] | None,
                  add_to: torch.Tensor | None, silu_mul: bool) -> None:
    if norm is not None and add_to is not None:
        raise ValueError("gemv: norm and add_to do not combine")
    if norm is not None:
        weight = norm[0]
        if weight.shape != (x2.shape[1],) or weight.dtype != torch.bfloat16 or weight.data_ptr() % _VEC_BYTES:
            raise ValueError(f"gemv: the norm weight must be 16-byte aligned bf16 [{x2.shape[1]}], got "
                             f"{weight.dtype} {list(weight.shape)}")
    if add_to is not None:
        shape_ok = add_to.shape == (x2.shape[0], n_out) and add_to.is_contiguous()
        if silu_mul or not shape_ok or add_to.dtype != torch.bfloat16:
            raise ValueError(f"gemv: add_to must be a contiguous bf16 [{x2.shape[0]}, {n_out}] (no SiLU-and-mul), got "
                             f"{add_to.dtype} {list(add_to.shape)}")


def _launch_inputs(x: torch.Tensor, k: int, module: Any, pdl: bool | None) -> tuple[torch.Tensor, Any, bool]:
    """x as the kernels read it ([M, K], contiguous, 16-byte aligned), the module (by default the one
    ``TPSERVE_GEMV_DEFINES`` names) and whether to launch with PDL (``TPSERVE_GEMV_PDL`` by default, where
    the GPU has it)."""
    x2 = x.reshape(-1, k).contiguous()
    if x2.data_ptr() % _VEC_BYTES:
        x2 = x2.clone()
    module = module or load_module(_defines(os.environ.get(DEFINES_ENV, "")))
    if pdl is None:
        pdl = os.environ.get(PDL_ENV, "1") != "0"
    return x2, module, pdl and pdl_supported(x.device.index or 0)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None = None, module: Any = None,
    pdl: bool | None = None, silu_mul: bool = False, norm: tuple[torch.Tensor, float] | None = None,
    add_to: torch.Tensor | None = None, row_scales: bool = False,
) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T in bf16 (FP8: times ``scale_inv`` per 128x128 block, or with ``row_scales``, one
    token, scale_inv [N, 1]: a row's scale times its sum); ``module``:
    a ``load_module(defines)`` variant (experiments); ``pdl`` defaults to ``TPSERVE_GEMV_PDL``.
    ``silu_mul``: weight is [gate; up] and the result [..., N / 2] is SiLU(x @ gate.T) * (x @ up.T).
    ``norm`` (weight, eps): x is RMS-normed first (x * rsqrt(mean(x^2) + eps) * weight, unrounded);
    ``add_to`` [M, N]: the product, rounded to bf16, is added to it in place, and it is returned."""
    reason = unsupported(x, weight, scale_inv, silu_mul, fused=norm is not None or add_to is not None,
                         row_scales=row_scales)
    if reason is not None:
        raise ValueError(f"gemv: {reason}")
    n, k = weight.shape
    n_out = n // 2 if silu_mul else n
    x2, module, pdl = _launch_inputs(x, k, module, pdl)
    _check_fusion(x2, n_out, norm, add_to, silu_mul)
    y = add_to if add_to is not None else torch.empty(x2.shape[0], n_out, dtype=torch.bfloat16, device=x.device)
    norm_weight, eps = norm if norm is not None else (None, 0.0)
    if scale_inv is None:
        module.gemv_bf16(x2, weight, y, pdl, silu_mul, norm_weight, eps, add_to is not None)
    elif row_scales:
        module.gemv_fp8_rows(x2, weight, scale_inv, y, pdl, silu_mul, norm_weight, eps, add_to is not None)
    else:
        module.gemv_fp8(x2, weight, scale_inv, y, pdl, silu_mul, norm_weight, eps, add_to is not None)
    return y if add_to is not None else y.view(*x.shape[:-1], n_out)


MAX_TOP_K = 16  # the expert GEMVs' (csrc/gemv.cu: kMaxTopK, kMaxExperts)
MAX_EXPERTS = 128


def experts_unsupported(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, logits: torch.Tensor, top_k: int,
    scales: ExpertScales | None = None,
) -> str | None:
    """Why ``experts`` cannot run one token ``x`` through these stacked experts, or None when it can."""
    if x.numel() != x.shape[-1] or x.dtype != torch.bfloat16:
        return "the expert GEMVs take one bf16 token"
    dtype = torch.float8_e4m3fn if scales is not None else torch.bfloat16
    if not (gate_up.dtype == down.dtype == dtype and gate_up.is_contiguous() and down.is_contiguous()):
        return f"the expert GEMVs take contiguous {dtype} experts"
    experts, hidden, inter = gate_up.shape[0], gate_up.shape[2], down.shape[2]
    if logits.dtype != torch.bfloat16 or logits.shape != (1, experts) or not logits.is_contiguous():
        return f"the router's logits must be contiguous bf16 [1, {experts}], got {logits.dtype} {list(logits.shape)}"
    if not (1 <= top_k <= MAX_TOP_K and experts <= MAX_EXPERTS):
        return f"top_k {top_k} of {experts} experts is outside {MAX_TOP_K} of {MAX_EXPERTS}"
    row_scales = scales is not None and scales.block[0] == 1
    multiple = 16 if row_scales else SCALE_BLOCK if scales is not None else 8
    if hidden % 16 or inter % multiple or gate_up.data_ptr() % _VEC_BYTES or down.data_ptr() % _VEC_BYTES:
        return (f"hidden ({hidden}) must be a multiple of 16, intermediate ({inter}) of {multiple}, the experts "
                "16-byte aligned")
    if scales is not None:
        # a scale per row: as StackedExperts holds them, one (1, max(H, I)) block a row
        blocks = ((experts, 2, inter, 1), (experts, hidden, 1)) if row_scales else None
        if not (scales.gate_up.is_contiguous() and scales.down.is_contiguous()):
            return "FP8 experts need contiguous scales"
        if row_scales and (tuple(scales.gate_up.shape), tuple(scales.down.shape)) != blocks:
            return (f"FP8 experts scaled per row need scales {[list(b) for b in blocks]}, got "
                    f"{[list(scales.gate_up.shape), list(scales.down.shape)]}")
        if not row_scales and scales.block != (SCALE_BLOCK, SCALE_BLOCK):
            return f"FP8 experts need scales per {SCALE_BLOCK}x{SCALE_BLOCK} block or per row, got {scales.block}"
    if x.device.type != "cuda" or gate_up.device != x.device or down.device != x.device:
        return "x and the experts must be on one CUDA device"
    return probe(x.device.index or 0)


def experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool,
    norm: tuple[torch.Tensor, float] | None = None, scales: ExpertScales | None = None,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token's MoE experts in two GEMVs that route themselves from the router's ``logits`` (bf16 [1, E]: softmax,
    top k, ties to the lower id, optionally renormalised, as ``kernels.moe_small.router_top_k``): [1, H] =
    sum_j weight_j * expert_j(x). gate_up [E, 2I, H] ([gate; up] rows), down [E, H, I], bf16 or (``scales``) FP8 in
    128x128 blocks or with a scale a row (``ExpertScales.block`` (1, K): [E, 2, I, 1] and [E, H, 1]).
    ``norm`` (weight, eps): of RMSNorm(x) * weight, normed as read; ``add_to`` [1, H]: the sum, rounded to bf16, is
    added to it in place (the residual stream) and it is returned. The module and PDL: as ``gemv``'s defaults."""
    reason = experts_unsupported(x, gate_up, down, logits, top_k, scales)
    if reason is not None:
        raise ValueError(f"expert gemv: {reason}")
    x2, module, pdl = _launch_inputs(x, x.shape[-1], None, None)
    _check_fusion(x2, gate_up.shape[1] // 2, norm, None, True)
    _check_fusion(x2, down.shape[1], None, add_to, False)
    act = torch.empty(top_k, down.shape[2], dtype=torch.bfloat16, device=x.device)
    norm_weight, eps = norm if norm is not None else (None, 0.0)
    gate_up_scales, down_scales = (scales.gate_up, scales.down) if scales is not None else (logits, logits)
    row_scales = scales is not None and scales.block[0] == 1
    module.moe_gate_up(x2, gate_up, gate_up_scales, logits, top_k, act, pdl, norm_weight, eps, row_scales)
    out = add_to if add_to is not None else torch.empty(1, down.shape[1], dtype=torch.bfloat16, device=x.device)
    module.moe_down(act, down, down_scales, logits, top_k, renormalize, out, pdl, add_to is not None, row_scales)
    return out if add_to is not None else out.view(*x.shape[:-1], down.shape[1])


@functools.cache
def probe(device_index: int) -> str | None:
    """Build and run each kernel once (at load, before CUDA graph capture): None, or why not (logged)."""
    device = torch.device("cuda", device_index)
    try:
        x = torch.ones(1, 256, dtype=torch.bfloat16, device=device)
        w = torch.ones(4, 256, dtype=torch.bfloat16, device=device)
        y_bf16 = gemv(x, w)
        y_fp8 = gemv(x, w.to(torch.float8_e4m3fn), torch.full((1, 2), 0.5, device=device))
        act = gemv(x * 0.01, torch.ones(8, 256, dtype=torch.bfloat16, device=device), silu_mul=True)
        sums = 256 * 0.010009765625  # 0.01 in bf16, summed: 2.5625 = silu's and up's input
        expected = sums / (1 + math.exp(-sums)) * sums
        if not (torch.all(y_bf16 == 256) and torch.all(y_fp8 == 128) and torch.all((act - expected).abs() < 0.05)):
            raise RuntimeError(f"computed {y_bf16.tolist()}, {y_fp8.tolist()} and {act.tolist()}, "
                               f"expected 256, 128 and {expected:.4f}")
        return None
    except Exception as exc:  # noqa: BLE001 -- no nvcc, no FlashInfer, an older GPU, ...
        logger.warning("the CUDA GEMV is unavailable (%s: %s)", type(exc).__name__, exc)
        return f"{type(exc).__name__}: {exc}"


@functools.cache
def probe_rows(device_index: int) -> str | None:
    """``probe``, then the kernel with a scale per row (``row_scales``) once: None, or why not (logged; the other
    kernels stay in use)."""
    failure = probe(device_index)
    if failure is not None:
        return failure
    device = torch.device("cuda", device_index)
    try:
        x = torch.ones(1, 256, dtype=torch.bfloat16, device=device)
        w = torch.ones(4, 256, dtype=torch.float8_e4m3fn, device=device)
        y = gemv(x, w, torch.tensor([[0.25], [0.5], [1.0], [2.0]], device=device), row_scales=True)
        if y.tolist() != [[64.0, 128.0, 256.0, 512.0]]:
            raise RuntimeError(f"computed {y.tolist()}, expected 64, 128, 256 and 512")
        return None
    except Exception as exc:  # noqa: BLE001 -- an older module, ...: row-scaled layers take Triton's GEMM
        logger.warning("the CUDA GEMV with a scale per row is unavailable (%s: %s)", type(exc).__name__, exc)
        return f"{type(exc).__name__}: {exc}"


def bf16_gemv_enabled(weight: torch.Tensor) -> bool:
    """Whether a bf16 layer takes ``gemv`` at few tokens where it runs: by default on Hopper (measured
    faster than cuBLAS); ``TPSERVE_BF16_GEMV`` (read at load) ``1``: other GPUs too, ``0``: off."""
    flag = os.environ.get(BF16_GEMV_ENV, "")
    if flag == "0" or weight.device.type != "cuda" or weight.dtype != torch.bfloat16:
        return False
    if flag != "1" and torch.cuda.get_device_capability(weight.device)[0] != 9:
        return False
    x = torch.empty(1, weight.shape[1], dtype=torch.bfloat16, device=weight.device)
    return unsupported(x, weight) is None and probe(weight.device.index or 0) is None


def silu_mul_enabled() -> bool:
    return os.environ.get(SILU_MUL_ENV, "1") != "0"


def fuse_norm_enabled(x: torch.Tensor) -> bool:
    """Whether the layers hand ``x`` to the GEMV with the add + RMSNorm fused (the kernel takes up to
    ``FUSED_MAX_TOKENS`` rows; the layers up to ``FUSE_NORM_MAX_TOKENS``)."""
    return os.environ.get(FUSE_NORM_ENV, "1") != "0" and x.numel() // x.shape[-1] <= FUSE_NORM_MAX_TOKENS


def bf16_takes_gemv(x: torch.Tensor, use_gemv: bool) -> bool:
    """Whether a bf16 layer with ``use_gemv`` (set at load) runs ``x`` through ``gemv``."""
    return use_gemv and 0 < x.numel() // x.shape[-1] <= BF16_GEMV_TOKENS


def linear(x: torch.Tensor, weight: torch.Tensor, use_gemv: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through ``gemv`` up to ``BF16_GEMV_TOKENS`` tokens when ``use_gemv`` (set at load)."""
    if bf16_takes_gemv(x, use_gemv):
        y = gemv(x, weight)
        return y if bias is None else y + bias
    return torch.nn.functional.linear(x, weight, bias)
