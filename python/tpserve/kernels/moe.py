"""A mixture-of-experts layer's experts as two grouped Triton GEMMs over (token, k) rows sorted by
expert, each expert's run padded to BLOCK_M so a block reads one expert's weights: [gate | up],
SiLU-and-mul, down scaled by the router weight, then each token's k rows summed.

CUDA-graph safe: no host reads, and shapes depend only on the token count (padded length at most
``rows + min(rows, experts) * (BLOCK_M - 1)``; blocks past the real length exit at once).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from tpserve.kernels.moe_small import small_batch_experts
from tpserve.quant.fp8 import ExpertScales
from tpserve.layers.activation import silu_and_mul


@triton.jit
def _weight_tile(w_ptrs, ws_ptr, expert, part, rows, k_first, offs_k, k_ok, n_ok, stride_se, stride_sp, stride_sn,
                 BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr, K_UNIFORM: tl.constexpr, dtype: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] tile of w at rows ``rows`` of its scales' part ``part`` and columns ``k_first + offs_k``,
    FP8 dequantized to ``dtype`` (the bits of experts dequantized at load). K_UNIFORM: the tile's K lies in one
    scale block (BK % BLOCK_K == 0), so its scales are one per column, loaded as a vector: a scale gathered per
    element made Qwen3-30B-A3B-FP8's batch-32 step 6.2x bf16's on an H100 (session 44)."""
    w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    if FP8:
        s_ptrs = ws_ptr + expert * stride_se + part[None, :] * stride_sp + (rows // BN)[None, :] * stride_sn
        if K_UNIFORM:
            s = tl.load(s_ptrs + k_first // BK, mask=n_ok[None, :], other=0.0)
        else:
            s = tl.load(s_ptrs + ((k_first + offs_k) // BK)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        w = (w.to(tl.float32) * s).to(dtype)
    return w


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, scale_ptr, sorted_rows_ptr, block_expert_ptr, padded_len_ptr,
    num_rows, N, K,
    stride_am, stride_we, stride_wn, stride_cm,
    A_ROWS_PER_TOKEN: tl.constexpr,  # top_k when a's rows are tokens (first GEMM), 1 when they are rows
    SCALE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ws_ptr=None, stride_se=0, stride_sp=0, stride_sn=0, part_rows=1,
    BN: tl.constexpr = 1, BK: tl.constexpr = 1, FP8: tl.constexpr = False, SILU: tl.constexpr = False,
    K_UNIFORM: tl.constexpr = False,
):
    """c[row, :N] = a[row // A_ROWS_PER_TOKEN] @ w[expert].T (* scale[row]) for the block's sorted rows.
    SILU (the first GEMM, w = [gate | up] with N rows each): c = silu(a @ gate.T) * (a @ up.T), from the
    float32 products. FP8: w is float8 with block scales ``ws`` (``ExpertScales``; rows past ``part_rows`` take
    the second part's), each tile dequantized to a's dtype before the product.
    The grid is 1-D, in groups of GROUP_M row blocks that take every column block before the next group
    (GROUP_M >= the row blocks: each column block over all rows first)."""
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_N)
    blocks_m = tl.num_programs(0) // blocks_n
    group_first = pid // (GROUP_M * blocks_n) * GROUP_M
    group_rows = tl.minimum(blocks_m - group_first, GROUP_M)
    pid_m = group_first + pid % (GROUP_M * blocks_n) % group_rows
    pid_n = pid % (GROUP_M * blocks_n) // group_rows
    if pid_m * BLOCK_M >= tl.load(padded_len_ptr):
        return
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    part = offs_n // part_rows
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (rows // A_ROWS_PER_TOKEN).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU:
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = _weight_tile(w_ptrs, ws_ptr, expert, part, offs_n - part * part_rows, k0 * BLOCK_K, offs_k, k_ok, n_ok,
                         stride_se, stride_sp, stride_sn, BN, BK, FP8, K_UNIFORM, a.dtype)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        if SILU:  # the up rows N further on, their scales part 1
            u = _weight_tile(w_ptrs + N * stride_wn, ws_ptr, expert, part + 1, offs_n, k0 * BLOCK_K, offs_k, k_ok,
                             n_ok, stride_se, stride_sp, stride_sn, BN, BK, FP8, K_UNIFORM, a.dtype)
            if IEEE:
                up += tl.dot(a, u, input_precision="ieee")
            else:
                up += tl.dot(a, u)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc)) * up
    if SCALE:
        acc *= tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class Tile:
    """One launch shape of the grouped GEMM: a block's rows and columns, its K step, warps, pipeline
    stages, and the row blocks in a group of the launch order (``_grouped_gemm_kernel``)."""

    block_m: int
    block_n: int
    block_k: int = 64
    warps: int = 4
    stages: int = 3
    group_m: int = 1 << 20  # every row block of a column block before the next column block
    # the first GEMM writes silu(gate) * up from its float32 products (block_n of each), not [gate | up] for
    # SiLU-and-mul to read back: a kernel fewer, and at 8,192 tokens of Qwen3-30B-A3B 400 MB of a layer's traffic
    # (computed from the shapes; moe_tiles times it)
    fuse_silu: bool = False


# The grouped GEMM's tile by (token, k) rows: up to each bound the tile beside it (None: any more rows).
# benchmarks/experiments/moe_tiles.py, H200, a Qwen3-30B-A3B MoE layer (the sort, both GEMMs, SiLU-and-mul, the
# sum over k): session 31 took BLOCK_K 128 at decode sizes (1.05x / 1.12x / 1.07x / 1.04x at 32 / 64 / 128 / 256
# tokens, where every expert's weights are read), and at 2,048 / 8,192 tokens 128 x 256 in 4 stages, each row
# block taking its column blocks in turn, 1.15x / 1.18x (session 5's 128 x 128 was 1.2x / 1.5x the 64 x 64 tile).
# Session 34: 32 x 64 with SiLU in the first GEMM 1.098x 32 x 128 at 256 tokens (+silu 0.99-1.012x at 32-128).
TILES_BY_ROWS: tuple[tuple[int | None, Tile], ...] = (
    (1024, Tile(16, 64, 128, group_m=1)),
    (2048, Tile(32, 64, 128, group_m=1, fuse_silu=True)),
    (4096, Tile(32, 128, 128, group_m=1)),
    (None, Tile(128, 256, warps=8, stages=4, group_m=1)),
)
# FP8 experts (128 x 128 blocks). Session 5's tiles were picked when a tile loaded a float32 scale per weight element;
# since session 44 a tile whose K lies in one scale block loads one scale a column (K_UNIFORM), and session 45 timed the
# bf16 table's tiles on FP8 experts (moe_tiles.py --sweep tables --fp8, H100): faster at 256 / 1,024 / 4,096 rows
# (1.30x / 1.48x / 1.11x session 5's 16 x 64 x 64 and 64 x 64 x 64), 128 x 128 x 64 still the best from 16,384.
FP8_TILES_BY_ROWS: tuple[tuple[int | None, Tile], ...] = (
    (1024, Tile(16, 64, 128, group_m=1)),
    (4096, Tile(32, 128, 128, group_m=1)),
    (None, Tile(128, 128, warps=8)),
)


def tiles_for(num_rows: int, fp8: bool = False, itemsize: int = 2, shared_bytes: int | None = None) -> Tile:
    """The grouped GEMM's tile at this many (token, k) rows (``TILES_BY_ROWS``, FP8 experts' apart); unquantized
    experts' tiles cut to fit ``shared_bytes`` (Hopper's by default) at elements of ``itemsize`` bytes."""
    tiles = FP8_TILES_BY_ROWS if fp8 else TILES_BY_ROWS
    tile = next(tile for bound, tile in tiles if bound is None or num_rows <= bound)
    return tile if fp8 else fit_shared_memory(tile, itemsize, shared_bytes or HOPPER_SHARED_MEMORY)


# The shared memory a block may opt into on Hopper (227 KB); the tiles above were picked for bf16 within it.
HOPPER_SHARED_MEMORY = 232448


@functools.cache
def shared_memory_bytes(device_index: int) -> int:
    """The shared memory a block may opt into on this GPU (Hopper 227 KB, A100 163 KB, Ada 99 KB)."""
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(device_index)["max_shared_mem"])


def fit_shared_memory(tile: Tile, itemsize: int, shared_bytes: int) -> Tile:
    """``tile`` with its pipeline buffers within ``shared_bytes``: Triton keeps stages - 1 copies of an A tile
    and one (SiLU fused: two) W tiles. Fewer stages first (down to 2), then narrower column blocks. float32
    models need it on Hopper: 128 x 256 in 4 stages asks 288 KB at 4 bytes an element."""
    def fits(stages: int, block_n: int) -> bool:
        w_tiles = 2 if tile.fuse_silu else 1
        return (stages - 1) * (tile.block_m + w_tiles * block_n) * tile.block_k * itemsize <= shared_bytes

    stages, block_n = tile.stages, tile.block_n
    while stages > 2 and not fits(stages, block_n):
        stages -= 1
    while block_n > 16 and not fits(stages, block_n):
        block_n //= 2
    return tile if (stages, block_n) == (tile.stages, tile.block_n) else replace(tile, stages=stages, block_n=block_n)


def tile_row_bounds() -> tuple[int, ...]:
    """Every row count at which some tile or the sort's form ends (each is a Triton kernel variant to compile)."""
    bounds = {bound for bound, _ in TILES_BY_ROWS + FP8_TILES_BY_ROWS if bound is not None}
    return tuple(sorted(bounds | {ALIGN_ONE_KERNEL_MAX_ROWS}))


def aligned_capacity(rows: int, num_experts: int, block_m: int) -> int:
    """Sorted rows of ``rows`` rows padded per expert, bounded by the row count alone."""
    capacity = rows + min(rows, num_experts) * (block_m - 1)
    return -(-capacity // block_m) * block_m


@triton.jit
def _expert_count_kernel(ids_ptr, chunk_counts_ptr, rows, E_PAD: tl.constexpr, COUNT_CHUNK: tl.constexpr):
    """Rows per expert in each COUNT_CHUNK rows: chunk_counts [chunks, E_PAD] for ``_align_kernel``'s COUNTED form."""
    every = tl.program_id(0) * COUNT_CHUNK + tl.arange(0, COUNT_CHUNK)
    ids = tl.load(ids_ptr + every, mask=every < rows, other=0).to(tl.int32)
    tl.store(chunk_counts_ptr + tl.program_id(0) * E_PAD + tl.arange(0, E_PAD),
             tl.histogram(ids, E_PAD, mask=every < rows))


@triton.jit
def _align_kernel(
    ids_ptr, sorted_rows_ptr, block_expert_ptr, padded_len_ptr, rows, capacity, num_experts, chunk_counts_ptr,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, HIST_CHUNK: tl.constexpr,
    COUNTED: tl.constexpr, COUNT_CHUNK: tl.constexpr,
):
    """Program p owns rows, sorted slots and blocks [p * CHUNK, (p + 1) * CHUNK). From histograms of the ids
    (read from L2, HIST_CHUNK at a time, so the row count is no compile-time constant) it has every
    expert's run and how many of its rows come before its own, so it places its rows (a stable sort), fills its
    padding slots and labels its blocks with no other program's results: no barrier. COUNTED (many rows): the
    chunk_counts of ``_expert_count_kernel`` replace the histograms of all but the ids of its own count chunk
    before its rows. Rows whose id is num_experts or more (another rank's expert: expert parallelism) are left
    out, as padding is."""
    first = tl.program_id(0) * CHUNK
    experts = tl.arange(0, E_PAD)
    real = experts < num_experts
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    before = tl.zeros((E_PAD,), dtype=tl.int32)
    hist_from = 0
    if COUNTED:
        chunks = tl.cdiv(rows, COUNT_CHUNK)
        own = first // COUNT_CHUNK
        for c0 in range(0, chunks, 16):
            c = c0 + tl.arange(0, 16)
            part = tl.load(chunk_counts_ptr + c[:, None] * E_PAD + experts[None, :], mask=(c < chunks)[:, None],
                           other=0)
            counts += tl.sum(part, axis=0)
            before += tl.sum(tl.where((c < own)[:, None], part, 0), axis=0)
        hist_from = own * COUNT_CHUNK
    for start in range(hist_from, tl.minimum(first, rows) if COUNTED else rows, HIST_CHUNK):
        every = start + tl.arange(0, HIST_CHUNK)
        every_id = tl.load(ids_ptr + every, mask=every < rows, other=0).to(tl.int32)
        if not COUNTED:
            counts += tl.histogram(every_id, E_PAD, mask=every < rows)
        before += tl.histogram(every_id, E_PAD, mask=every < tl.minimum(first, rows))
    counts = tl.where(real, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    used = tl.sum(padded, axis=0)
    if first == 0:
        tl.store(padded_len_ptr, used)
    offs = first + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < rows, other=E_PAD).to(tl.int32)  # E_PAD: no expert's
    base = tl.sum(tl.where(ids[:, None] == experts[None, :], (starts + before)[None, :], 0), axis=1)
    rank = tl.sum(((ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)
    tl.store(sorted_rows_ptr + base + rank, offs, mask=(offs < rows) & (ids < num_experts))
    # The run a slot falls in is the number of runs ending at or before it; past its rows it is padding.
    run = tl.sum(((ends[None, :] <= offs[:, None]) & real[None, :]).to(tl.int32), axis=1)
    filled = tl.sum(tl.where(run[:, None] == experts[None, :], (starts + counts)[None, :], 0), axis=1)
    tl.store(sorted_rows_ptr + offs, tl.zeros_like(offs) + rows, mask=(offs < capacity) & (offs >= filled))
    label = tl.sum(((ends[None, :] <= (offs * BLOCK_M)[:, None]) & real[None, :]).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + offs, tl.minimum(label, num_experts - 1), mask=offs < capacity // BLOCK_M)


# Rows, slots and blocks an ``_align_kernel`` program takes, in one kernel / counted first. moe_align (H200,
# session 34): chunks of 32 took 6.2 us at 9-64 tokens of top 8 against 8.7-9.1 for 64, 10.4 against 12.2 at 256.
ALIGN_CHUNK = 32
ALIGN_COUNTED_CHUNK = 64
ALIGN_HIST_CHUNK = 512  # ids a step of its histograms
# Past this many rows each program's histograms of all ids would outweigh a second launch:
# ``_expert_count_kernel`` counts each ALIGN_COUNT_CHUNK rows first.
ALIGN_ONE_KERNEL_MAX_ROWS = 4096
ALIGN_COUNT_CHUNK = 2048


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int, one_kernel_max_rows: int = ALIGN_ONE_KERNEL_MAX_ROWS,
    count_chunk: int = ALIGN_COUNT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, k) rows of ``ids`` [T, k] by expert, runs padded to ``block_m``, no host sync:
    sorted_rows [P] (``T * k`` marks padding), block_expert [P / block_m], padded_len [1] (P: by T).
    Rows with id ``num_experts`` (another rank's expert) are left out. Past ``one_kernel_max_rows`` rows,
    ``_expert_count_kernel`` first counts each ``count_chunk`` rows (a power of two)."""
    ids = ids.contiguous()
    rows = ids.numel()
    capacity = aligned_capacity(rows, num_experts, block_m)
    sorted_rows = torch.empty(capacity, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=ids.device)
    padded_len = torch.empty(1, dtype=torch.int32, device=ids.device)
    e_pad = triton.next_power_of_2(num_experts + 1)
    counted = rows > one_kernel_max_rows
    chunk_counts = padded_len  # unread unless counted
    if counted:
        chunk_counts = torch.empty(triton.cdiv(rows, count_chunk), e_pad, dtype=torch.int32, device=ids.device)
        _expert_count_kernel[(chunk_counts.shape[0],)](ids, chunk_counts, rows, E_PAD=e_pad,
                                                       COUNT_CHUNK=count_chunk, num_warps=4)
    chunk = ALIGN_COUNTED_CHUNK if counted else ALIGN_CHUNK
    _align_kernel[(triton.cdiv(capacity, chunk),)](
        ids, sorted_rows, block_expert, padded_len, rows, capacity, num_experts, chunk_counts, BLOCK_M=block_m,
        E_PAD=e_pad, CHUNK=chunk, HIST_CHUNK=ALIGN_HIST_CHUNK, COUNTED=counted, COUNT_CHUNK=count_chunk,
        num_warps=4,
    )
    return sorted_rows, block_expert, padded_len


def align_by_expert_torch(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``align_by_expert`` in torch ops (the reference, and the CPU path)."""
    flat = ids.flatten()
    rows = flat.numel()
    capacity = aligned_capacity(rows, num_experts, block_m)
    # The last count is other ranks' experts', which add 0. (Not ``counts[num_experts] = 0``: a Python scalar set
    # into a CUDA tensor is a copy from the host and a stream sync, one a MoE layer, which cost Qwen3-30B-A3B's
    # 8,192-token prefill step 48 syncs on an H200: session 30, docs/results/history.md.)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, (flat < num_experts).to(torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    by_expert = flat[order]
    rank = torch.arange(rows, device=ids.device) - (counts.cumsum(0) - counts)[by_expert]
    # other ranks' rows go to one slot past the end, cut off after (no host sync)
    slots = torch.where(by_expert < num_experts, (ends - padded)[by_expert] + rank, capacity)
    sorted_rows = torch.full((capacity + 1,), rows, dtype=torch.int32, device=ids.device)
    sorted_rows[slots] = order.to(torch.int32)
    sorted_rows, ends = sorted_rows[:capacity], ends[:num_experts]
    block_starts = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_rows, block_expert, ends[-1:]


def _grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scale: torch.Tensor | None,
    sorted_rows: torch.Tensor, block_expert: torch.Tensor, padded_len: torch.Tensor,
    num_rows: int, rows_per_token: int, tile: Tile, w_scale: torch.Tensor | None = None,
    block: tuple[int, int] = (1, 1), silu: bool = False,
) -> None:
    """``tile``: the launch, whose BLOCK_M the rows were sorted in; ``w_scale``: w is FP8 with these block scales
    ([E, 2, ...] of gate_up, whose rows split in two parts, or [E, ...] of down); ``silu``: w is [gate | up] and
    out takes silu(gate) * up."""
    rows_w, k = w.shape[1], w.shape[2]
    n = rows_w // 2 if silu else rows_w
    block_k = min(tile.block_k, max(16, triton.next_power_of_2(k)))
    grid = (sorted_rows.numel() // tile.block_m * triton.cdiv(n, tile.block_n),)
    _grouped_gemm_kernel[grid](
        a, w, out, scale if scale is not None else out, sorted_rows, block_expert, padded_len,
        num_rows, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROWS_PER_TOKEN=rows_per_token, SCALE=scale is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k, GROUP_M=tile.group_m, num_warps=tile.warps,
        num_stages=tile.stages, SILU=silu, **_weight_scale_args(w_scale, rows_w, k, block, block_k, a),
    )


def _weight_scale_args(w_scale: torch.Tensor | None, n: int, k: int, block: tuple[int, int], block_k: int,
                       dummy: torch.Tensor) -> dict:
    """K_UNIFORM: each BLOCK_K chunk of K lies in one scale block (``block_k`` divides it, or one block spans K)."""
    if w_scale is None:
        return dict(ws_ptr=dummy)
    parts = w_scale.dim() == 4  # gate_up's scales: [E, 2, rows, cols]
    return dict(ws_ptr=w_scale, stride_se=w_scale.stride(0), stride_sp=w_scale.stride(1) if parts else 0,
                stride_sn=w_scale.stride(-2), part_rows=n // 2 if parts else n, BN=block[0], BK=block[1], FP8=True,
                K_UNIFORM=block[1] % block_k == 0 or block[1] >= k)


# Up to this many (token, k) rows the experts run as ``kernels.moe_small``'s two unsorted kernels:
# at decode nearly every row has its own expert, so the grouped path's sort and blocks are overhead.
# 64 rows: Qwen3-30B-A3B (top 8) up to 8 tokens; benchmarks/experiments/moe_small_batch.py.
SMALL_BATCH_MAX_ROWS = 64


def fused_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    scales: ExpertScales | None = None, skip_others: bool = False,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) [T, H]; gate_up [E, 2I, H], down [E, H, I] (FP8 with
    ``scales``). ``skip_others``: ids equal to E are another rank's experts (expert parallelism), adding 0."""
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("fused_experts needs contiguous expert weights")
    x = x.contiguous()
    rows = ids.numel()
    if rows == 0:
        return torch.zeros_like(x)
    if rows <= SMALL_BATCH_MAX_ROWS:
        return small_batch_experts(x, gate_up, down, weights, ids, scales=scales, skip_others=skip_others)
    return grouped_experts(x, gate_up, down, weights, ids, scales, skip_others)


def grouped_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    scales: ExpertScales | None = None, skip_others: bool = False, tile: Tile | None = None,
) -> torch.Tensor:
    """``fused_experts`` by the grouped GEMMs (any row count; contiguous weights). Other ranks' rows are left
    out of the sort, so their down rows are zeroed first. ``tile``: both GEMMs' launch (``tiles_for``'s)."""
    x = x.contiguous()
    tokens, top_k = ids.shape
    rows = tokens * top_k
    if rows == 0:
        return torch.zeros_like(x)
    if tile is None:
        shared = shared_memory_bytes(x.device.index) if x.is_cuda else None
        tile = tiles_for(rows, fp8=scales is not None, itemsize=x.element_size(), shared_bytes=shared)
    sorted_rows, block_expert, padded_len = align_by_expert(ids, gate_up.shape[0], tile.block_m)
    gate_up_scale, down_scale, block = (scales.gate_up, scales.down, scales.block) if scales else (None, None, (1, 1))
    width = gate_up.shape[1] // 2 if tile.fuse_silu else gate_up.shape[1]
    hidden = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, hidden, None, sorted_rows, block_expert, padded_len, rows, top_k, tile,
                  gate_up_scale, block, silu=tile.fuse_silu)
    if not tile.fuse_silu:
        hidden = silu_and_mul(hidden)
    down_out = (torch.zeros if skip_others else torch.empty)(rows, down.shape[1], dtype=x.dtype, device=x.device)
    scale = weights.reshape(-1).contiguous()
    _grouped_gemm(hidden, down, down_out, scale, sorted_rows, block_expert, padded_len, rows, 1, tile,
                  down_scale, block)
    return down_out.view(tokens, top_k, -1).sum(dim=1)
