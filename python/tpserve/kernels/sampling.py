"""Sampling in one Triton kernel for rows with a temperature and no top-k/top-p/min-p filter
(and greedy rows): the same counter-based noise and exponential race as ``engine/sampler.py``.

Each program owns one row and makes two passes over its logits: the row max, then
``argmax(exp((logit - max) / t) / -log(u))`` with ``u`` from the same splitmix32 hash of
(seed, step, vocab index). The operations are the torch path's, each rounded the same way
(IEEE division, CUDA's libdevice ``expf``/``logf``, first index on ties), so tokens are expected
to match the torch path; a difference could only come from an ulp of ``exp``/``log`` at a
near-exact tie. There are no atomics: a row's result depends only on that row, so every
tensor-parallel rank picks the same tokens from the same logits.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# The constants of engine/sampler.py (splitmix32 multipliers, domain separators, 23-bit uniforms).
_MUL1: tl.constexpr = tl.constexpr(0x21F0AAAD)
_MUL2: tl.constexpr = tl.constexpr(0x735A2D97)
_ROW_DOMAIN: tl.constexpr = tl.constexpr(0x9E3779B9)
_COL_DOMAIN: tl.constexpr = tl.constexpr(0x85EBCA6B)
_UNIFORM_SHIFT: tl.constexpr = tl.constexpr(9)  # 32 - 23 bits
_UNIFORM_SCALE: tl.constexpr = tl.constexpr(1.0 / 8388608.0)  # 2**-23

BLOCK = 2048
# Triton's CPU interpreter (TRITON_INTERPRET=1, for tests without a GPU) has no libdevice: there
# the kernel uses numpy's float32 exp/log and division instead.
_LIBDEVICE = os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _div(x, y, LIBDEVICE: tl.constexpr):
    """IEEE round-to-nearest division (Triton's '/' is approximate on the GPU)."""
    if LIBDEVICE:
        return libdevice.div_rn(x, y)
    else:
        return x / y


@triton.jit
def _mix32(x):
    """splitmix32's output function on uint32 (wrapping multiply, logical shifts)."""
    x = x ^ (x >> 16)
    x = x * _MUL1
    x = x ^ (x >> 15)
    x = x * _MUL2
    return x ^ (x >> 15)


@triton.jit
def _row_key(seed, step):
    """engine/sampler.py's ``_row_keys``: the four 32-bit words of (seed, step), absorbed in turn."""
    key = tl.full((1,), _ROW_DOMAIN, tl.uint32)
    key = _mix32(key ^ (seed & 0xFFFFFFFF).to(tl.uint32))
    key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    key = _mix32(key ^ (step & 0xFFFFFFFF).to(tl.uint32))
    return _mix32(key ^ ((step >> 32) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _sample_kernel(
    logits_ptr, row_stride, temperatures_ptr, seeds_ptr, steps_ptr, out_ptr,
    VOCAB: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0)
    row_logits = logits_ptr + row.to(tl.int64) * row_stride
    offs = tl.arange(0, BLOCK)

    # Pass 1: the row max, in float32 (exact for half-precision logits).
    row_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, VOCAB, BLOCK):
        cols = start + offs
        x = tl.load(row_logits + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
        row_max = tl.maximum(row_max, x)
    m = tl.max(row_max, axis=0)

    t = tl.load(temperatures_ptr + row + tl.zeros((1,), tl.int32))
    greedy = t == 0.0
    t = tl.where(greedy, 1.0, t)
    key = _row_key(tl.load(seeds_ptr + row + tl.zeros((1,), tl.int32)), tl.load(steps_ptr + row + tl.zeros((1,), tl.int32)))

    # Pass 2: the race. Each lane keeps its best (score, index); strict '>' keeps the first index.
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, VOCAB, BLOCK):
        cols = start + offs
        valid = cols < VOCAB
        x = tl.load(row_logits + cols, mask=valid, other=float("-inf")).to(tl.float32)
        bits = _mix32(key ^ _mix32(cols.to(tl.uint32) ^ _COL_DOMAIN))
        u = ((bits >> _UNIFORM_SHIFT).to(tl.float32) + 0.5) * _UNIFORM_SCALE
        weight = _exp(_div(x - m, t, LIBDEVICE), LIBDEVICE)
        race = _div(weight, -_log(u, LIBDEVICE), LIBDEVICE)
        score = tl.where(greedy, x, race)
        score = tl.where(valid, score, float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_idx, VOCAB), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """[B] int64 tokens of [B, V] logits (any float dtype, last dim contiguous): argmax for rows
    with temperature 0, the unfiltered exponential race at temperature t otherwise."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"sampling kernel needs [B, V] logits with a contiguous last dim, got {tuple(logits.shape)}")
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    _sample_kernel[(batch,)](
        logits, logits.stride(0), temperatures, seeds, steps, out, VOCAB=vocab, BLOCK=BLOCK, LIBDEVICE=_LIBDEVICE, num_warps=8
    )
    return out
