"""Sampling in Triton: the counter-based noise and exponential race of ``engine/sampler.py``,
greedy rows (``greedy`` for an all-greedy batch), and top-k / top-p / min-p without sorting.

Unfiltered rows are split into chunks (a pass for the row max, one for the race, then a pick of
the best chunk); the filter variant gives each row one program. Every operation is rounded as in
the torch path (IEEE division, libdevice ``expf``/``logf``, first index on ties), so tokens match
it but for an ulp of exp/log at a near tie; nothing depends on the order programs finish in (the
greedy kernel's atomic only counts them), so every TP rank picks the same tokens.

Filters: ``w = f(x) = exp((x - max) / t)`` is monotone in the logit, so each cut-off is found on
the logits by bisection over the monotone int32 keys of their float32 values (<= 32 passes):
* top-k: the k-th largest logit ``x_k`` is the largest key with ``count(x >= key) >= k``, and the
  torch threshold ``sorted_w[k - 1]`` is exactly ``f(x_k)`` (ties kept alike);
* top-p: the top-k mass is ``sum(f(x), x > x_k) + (k - count(x > x_k)) f(x_k)``; the cut-off is the
  smallest key ``c >= x_k`` with ``sum(f(x), x > c) < top_p * mass`` (sums via ``exp2``, in another
  order than torch's cumsum: only a near tie of the mass with ``top_p`` can differ);
* min-p: weights below ``min_p`` (the top weight is exactly 1).
The race keeps ``w >= max(f(cut-off), min_p)``, ``f`` as in the race, so ties at the cut-off stay.
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

BLOCK = 2048  # the filter kernel's tile (one program per row)
CHUNK = 4096  # the unfiltered race's slice of a row per program
# Triton's CPU interpreter (TRITON_INTERPRET=1, tests without a GPU) has no libdevice: numpy's instead.
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
def _load_logits(
    logits_ptr, row_stride, bitmask_ptr, mask_stride, row, cols, VOCAB: tl.constexpr, HAS_MASK: tl.constexpr
):
    """A row's logits at ``cols`` in float32; with a grammar bitmask (bit j of int32 word w allows
    token 32 w + j), the tokens it does not allow are -inf, as xgrammar's in-place mask sets them."""
    valid = cols < VOCAB
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + cols, mask=valid, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        words = tl.load(bitmask_ptr + row.to(tl.int64) * mask_stride + cols // 32, mask=valid, other=0)
        x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
    return x


@triton.jit
def _chunk_max_kernel(
    logits_ptr, row_stride, bitmask_ptr, mask_stride, partial_max_ptr,
    VOCAB: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """Program (row, chunk): the max of one chunk of the row, in float32."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = _load_logits(logits_ptr, row_stride, bitmask_ptr, mask_stride, row, cols, VOCAB, HAS_MASK)
    tl.store(partial_max_ptr + row * NUM_CHUNKS + chunk, tl.max(x, axis=0))


@triton.jit
def _chunk_race_kernel(
    logits_ptr, row_stride, bitmask_ptr, mask_stride, temperatures_ptr, seeds_ptr, steps_ptr, partial_max_ptr,
    partial_score_ptr, partial_idx_ptr, VOCAB: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    CHUNKS_POW2: tl.constexpr, LIBDEVICE: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """Program (row, chunk): the race over one chunk, with the row max of every chunk's max
    (max is exact in any order). Writes the chunk's best score and its first index."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    chunk_ids = tl.arange(0, CHUNKS_POW2)
    maxes = tl.load(partial_max_ptr + row * NUM_CHUNKS + chunk_ids, mask=chunk_ids < NUM_CHUNKS, other=float("-inf"))
    m = tl.max(maxes, axis=0)

    t = tl.load(temperatures_ptr + row + tl.zeros((1,), tl.int32))
    greedy = t == 0.0
    t = tl.where(greedy, 1.0, t)
    key = _row_key(tl.load(seeds_ptr + row + tl.zeros((1,), tl.int32)), tl.load(steps_ptr + row + tl.zeros((1,), tl.int32)))

    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = cols < VOCAB
    x = _load_logits(logits_ptr, row_stride, bitmask_ptr, mask_stride, row, cols, VOCAB, HAS_MASK)
    bits = _mix32(key ^ _mix32(cols.to(tl.uint32) ^ _COL_DOMAIN))
    u = ((bits >> _UNIFORM_SHIFT).to(tl.float32) + 0.5) * _UNIFORM_SCALE
    weight = _exp(_div(x - m, t, LIBDEVICE), LIBDEVICE)
    race = _div(weight, -_log(u, LIBDEVICE), LIBDEVICE)
    score = tl.where(greedy, x, race)
    score = tl.where(valid, score, float("-inf"))
    top = tl.max(score, axis=0)
    first = tl.min(tl.where(score == top, cols, VOCAB), axis=0)
    tl.store(partial_score_ptr + row * NUM_CHUNKS + chunk, top)
    tl.store(partial_idx_ptr + row * NUM_CHUNKS + chunk, first)


@triton.jit
def _pick_kernel(
    partial_score_ptr, partial_idx_ptr, out_ptr,
    VOCAB: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNKS_POW2: tl.constexpr,
):
    """Program (row): the best chunk; on equal scores the lowest index (chunks are in order)."""
    row = tl.program_id(0)
    chunk_ids = tl.arange(0, CHUNKS_POW2)
    valid = chunk_ids < NUM_CHUNKS
    scores = tl.load(partial_score_ptr + row * NUM_CHUNKS + chunk_ids, mask=valid, other=float("-inf"))
    idx = tl.load(partial_idx_ptr + row * NUM_CHUNKS + chunk_ids, mask=valid, other=VOCAB)
    top = tl.max(scores, axis=0)
    token = tl.min(tl.where(scores == top, idx, VOCAB), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _greedy_kernel(
    logits_ptr, row_stride, partial_max_ptr, partial_idx_ptr, counters_ptr, out_ptr,
    VOCAB: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNKS_POW2: tl.constexpr,
):
    """Program (row, chunk): the chunk's max and its first index; the row's last program to finish
    (an atomic count) picks the best chunk, the lowest index on equal maxima, and resets the count.
    A NaN counts as the largest value (torch.argmax's rule): a chunk holding one reports NaN."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + cols, mask=cols < VOCAB, other=float("-inf"))
    x = x.to(tl.float32)
    nan = x != x
    top = tl.max(tl.where(nan, float("-inf"), x), axis=0)
    first = tl.min(tl.where(x == top, cols, VOCAB), axis=0)
    first_nan = tl.min(tl.where(nan, cols, VOCAB), axis=0)
    has_nan = first_nan < VOCAB
    tl.store(partial_max_ptr + row * NUM_CHUNKS + chunk, tl.where(has_nan, float("nan"), top))
    tl.store(partial_idx_ptr + row * NUM_CHUNKS + chunk, tl.where(has_nan, first_nan, first))
    tl.debug_barrier()  # every thread's partials are written before the release below
    if tl.atomic_add(counters_ptr + row, 1, sem="acq_rel") == NUM_CHUNKS - 1:
        chunk_ids = tl.arange(0, CHUNKS_POW2)
        valid = chunk_ids < NUM_CHUNKS
        maxes = tl.load(partial_max_ptr + row * NUM_CHUNKS + chunk_ids, mask=valid, other=float("-inf"),
                        cache_modifier=".cg")
        idx = tl.load(partial_idx_ptr + row * NUM_CHUNKS + chunk_ids, mask=valid, other=VOCAB, cache_modifier=".cg")
        nan_chunks = maxes != maxes
        best = tl.max(tl.where(nan_chunks, float("-inf"), maxes), axis=0)
        token = tl.min(tl.where(maxes == best, idx, VOCAB), axis=0)
        first_nan = tl.min(tl.where(nan_chunks, idx, VOCAB), axis=0)  # chunks are in order: the first NaN
        token = tl.where(first_nan < VOCAB, first_nan, token)
        tl.store(out_ptr + row, token.to(tl.int64))
        tl.store(counters_ptr + row, 0)


def greedy(logits: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[B] int64 argmax of [B, V] logits (last dim contiguous), the first index on ties, as
    ``torch.argmax`` but in one launch: ~40 programs a row each take a chunk, and the last of a row
    merges (torch's reduction took 8 us for one row of 152k logits on an H200, docs/benchmarks.md).
    ``counters``: [>= B] int32 zeros, left zero."""
    if logits.dim() != 2 or logits.stride(1) != 1 or counters.numel() < logits.shape[0]:
        raise ValueError(f"greedy needs [B, V] logits with a contiguous last dim and B counters, got "
                         f"{tuple(logits.shape)} and {counters.numel()}")
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    maxes = torch.empty((batch, chunks), dtype=torch.float32, device=logits.device)
    indices = torch.empty((batch, chunks), dtype=torch.int32, device=logits.device)
    _greedy_kernel[(batch, chunks)](
        logits, logits.stride(0), maxes, indices, counters, out,
        VOCAB=vocab, CHUNK=CHUNK, NUM_CHUNKS=chunks, CHUNKS_POW2=triton.next_power_of_2(chunks),
    )
    return out


@triton.jit
def _key(x):
    """Monotone int32 key of float32 values (-0.0 and +0.0 share the key 0)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(x == 0.0, 0, key)


@triton.jit
def _unkey(key):
    """The float32 value of a key (inverse of ``_key``)."""
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _count_ge(row_logits, mid, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    """How many logits of the row have a key >= mid."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, VOCAB, BLOCK):
        cols = start + offs
        x = tl.load(row_logits + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
        acc += ((_key(x) >= mid) & (cols < VOCAB)).to(tl.int32)
    return tl.sum(acc, axis=0)


@triton.jit
def _mass_gt(row_logits, mid, m, scale, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    """(sum of exp2((x - m) * scale), count) over the row's logits with a key > mid."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    cnt = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, VOCAB, BLOCK):
        cols = start + offs
        x = tl.load(row_logits + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
        above = (_key(x) > mid) & (cols < VOCAB)
        acc += tl.where(above, tl.exp2((x - m) * scale), 0.0)
        cnt += above.to(tl.int32)
    return tl.sum(acc, axis=0), tl.sum(cnt, axis=0)


@triton.jit
def _filter_sample_kernel(
    logits_ptr, row_stride, temperatures_ptr, seeds_ptr, steps_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr,
    out_ptr, VOCAB: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0)
    row_logits = logits_ptr + row.to(tl.int64) * row_stride
    offs = tl.arange(0, BLOCK)

    # Pass 1: the row max and min, in float32 (exact for half-precision logits).
    row_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    row_min = tl.full((BLOCK,), float("inf"), tl.float32)
    for start in range(0, VOCAB, BLOCK):
        cols = start + offs
        valid = cols < VOCAB
        x = tl.load(row_logits + cols, mask=valid, other=float("-inf")).to(tl.float32)
        row_max = tl.maximum(row_max, x)
        row_min = tl.minimum(row_min, tl.where(valid, x, float("inf")))
    m = tl.max(row_max, axis=0)
    lowest = tl.min(row_min, axis=0)

    t_in = tl.load(temperatures_ptr + row)
    greedy = t_in == 0.0
    t = tl.where(greedy, 1.0, t_in)
    top_k = tl.minimum(tl.maximum(tl.load(top_ks_ptr + row), 1), VOCAB).to(tl.int32)
    top_p = tl.load(top_ps_ptr + row)
    min_p = tl.load(min_ps_ptr + row)

    # The cut-off logit's key (the row min's key: keep everything) and the weight threshold.
    low_key = _key(lowest).to(tl.int64)
    high_key = _key(m).to(tl.int64)
    cut = low_key
    if t_in != 0.0:
        if top_k < VOCAB:
            # Largest key with count(key(x) >= key) >= k: the k-th largest logit.
            lo = low_key
            hi = high_key
            while lo < hi:
                mid = lo + (hi - lo + 1) // 2
                if _count_ge(row_logits, mid.to(tl.int32), VOCAB, BLOCK) >= top_k:
                    lo = mid
                else:
                    hi = mid - 1
            cut = lo
        if top_p < 1.0:
            scale = 1.4426950408889634 / t
            x_k = _unkey(cut.to(tl.int32))
            w_k = tl.exp2((x_k - m) * scale)
            mass_above, count_above = _mass_gt(row_logits, cut.to(tl.int32), m, scale, VOCAB, BLOCK)
            target = top_p * (mass_above + (top_k - count_above).to(tl.float32) * w_k)
            # Smallest key in [cut, max] whose strictly-larger mass is below the target.
            lo = cut
            hi = high_key
            while lo < hi:
                mid = lo + (hi - lo) // 2
                mass, _ = _mass_gt(row_logits, mid.to(tl.int32), m, scale, VOCAB, BLOCK)
                if mass < target:
                    hi = mid
                else:
                    lo = mid + 1
            cut = lo
    # Exactly the race's weight of the cut-off logit (the row min's when nothing cuts: <= every w).
    cut_x = _unkey(cut.to(tl.int32))
    threshold = _exp(_div(cut_x - m, t, LIBDEVICE), LIBDEVICE)
    threshold = tl.maximum(threshold, min_p)

    key = _row_key(tl.load(seeds_ptr + row + tl.zeros((1,), tl.int32)), tl.load(steps_ptr + row + tl.zeros((1,), tl.int32)))

    # The race, as in _sample_kernel; dropped tokens score 0 (the torch path's 0 / E).
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, VOCAB, BLOCK):
        cols = start + offs
        valid = cols < VOCAB
        x = tl.load(row_logits + cols, mask=valid, other=float("-inf")).to(tl.float32)
        bits = _mix32(key ^ _mix32(cols.to(tl.uint32) ^ _COL_DOMAIN))
        u = ((bits >> _UNIFORM_SHIFT).to(tl.float32) + 0.5) * _UNIFORM_SCALE
        weight = _exp(_div(x - m, t, LIBDEVICE), LIBDEVICE)
        race = tl.where(weight >= threshold, _div(weight, -_log(u, LIBDEVICE), LIBDEVICE), 0.0)
        score = tl.where(greedy, x, race)
        score = tl.where(valid, score, float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_idx, VOCAB), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))


def _split_race(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, out: torch.Tensor,
    bitmask: torch.Tensor | None,
) -> None:
    """The unfiltered race with many programs per row: a whole row in one program leaves most
    of the GPU idle at small batches (one row of 152k logits took ~0.17 ms at batch 1)."""
    batch, vocab = logits.shape
    chunks = triton.cdiv(vocab, CHUNK)
    chunks_pow2 = triton.next_power_of_2(chunks)
    # Separate allocations, so every buffer is aligned (Triton specialises on alignment).
    maxes = torch.empty((batch, chunks), dtype=torch.float32, device=logits.device)
    scores = torch.empty((batch, chunks), dtype=torch.float32, device=logits.device)
    indices = torch.empty((batch, chunks), dtype=torch.int32, device=logits.device)
    masked = bitmask is not None
    mask_args = (bitmask, bitmask.stride(0)) if masked else (logits, 0)  # unread without a mask
    _chunk_max_kernel[(batch, chunks)](
        logits, logits.stride(0), *mask_args, maxes, VOCAB=vocab, CHUNK=CHUNK, NUM_CHUNKS=chunks, HAS_MASK=masked
    )
    _chunk_race_kernel[(batch, chunks)](
        logits, logits.stride(0), *mask_args, temperatures, seeds, steps, maxes, scores, indices,
        VOCAB=vocab, CHUNK=CHUNK, NUM_CHUNKS=chunks, CHUNKS_POW2=chunks_pow2, LIBDEVICE=_LIBDEVICE, HAS_MASK=masked,
        num_warps=4,
    )
    _pick_kernel[(batch,)](scores, indices, out, VOCAB=vocab, NUM_CHUNKS=chunks, CHUNKS_POW2=chunks_pow2)


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    top_ks: torch.Tensor | None = None,
    top_ps: torch.Tensor | None = None,
    min_ps: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B] int64 tokens of [B, V] logits (any float dtype, last dim contiguous): argmax for rows
    with temperature 0, the exponential race at temperature t otherwise, over the tokens that
    top-k ([B] int64, V when off), top-p and min-p ([B] float32) keep when those are given (all
    three or none). ``bitmask`` ([B, ceil(V / 32)] int32, unfiltered rows only): grammar masks
    applied as the logits are read, the same tokens as masking the logits first."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"sampling kernel needs [B, V] logits with a contiguous last dim, got {tuple(logits.shape)}")
    filters = (top_ks, top_ps, min_ps)
    if any(f is None for f in filters) and not all(f is None for f in filters):
        raise ValueError("give top_ks, top_ps and min_ps together, or none of them")
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    if top_ks is None:
        _split_race(logits, temperatures, seeds, steps, out, bitmask)
    elif bitmask is not None:
        raise ValueError("the filtering kernel takes no bitmask: mask the logits first")
    else:
        _filter_sample_kernel[(batch,)](
            logits, logits.stride(0), temperatures, seeds, steps, top_ks, top_ps, min_ps, out,
            VOCAB=vocab, BLOCK=BLOCK, LIBDEVICE=_LIBDEVICE, num_warps=8,
        )
    return out
