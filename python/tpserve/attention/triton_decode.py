"""Split-KV decode attention in Triton over a dense page table (``attention/page_table.py``).

Why: at small batches FlashInfer's decode wrapper is latency-bound. In a batch-1 graph step on an
H200 it takes 8.5-9.3 us plus 2.3-2.5 us of split merging per layer for 1 MB of KV, which takes
0.25 us to read (docs/results/history.md, "Where a batch-1 step goes").

The grid is (batch, kv heads, splits), the splits chosen from the batch size so that the grid fills
the GPU (``splits_for``). Each program takes the GQA group's query heads (padded to 16 rows for
``tl.dot``) over one split of its sequence, CHUNK tokens a step, with an online softmax. How many
splits a sequence uses follows its length inside the kernel: at least CHUNK tokens a split, so a
graph captured once serves every context length, and programs past a short sequence's splits
return at once. Each program loads its first chunk's k and v before it waits on the previous kernel
(PDL): only the newest token's row is that kernel's (the newest ``fresh_tokens`` rows where a drafted step runs a row
a token), and it is read again after the wait. A sequence of one split writes its output directly.
Otherwise the program that finishes last merges the partials: an atomic counter tells it that it is
last, and it sets the counter back to zero (so graph replays need no memset).

On one H200, alone (benchmarks/experiments/triton_decode_attention.py, L2 cold, session 11): 0.53-0.86x
the wrapper's time at batch 1-8 and context 512, 0.74x at batch 1 and context 4096 with 32:8 heads,
0.90-1.00x at batch 8-32 from 4096 to 16k tokens; slower at batch 1 and 16k with 4 KV heads (1.13x).
Whole pipelined steps (session 12, with PDL): 0.95-0.97x the wrapper's at batch 1-32, so
``--decode-attention auto`` takes it up to ``AUTO_MAX_BATCH`` sequences over bf16/fp16 pages on
Hopper; ``triton`` takes it at every batch size.

Session 22's CUDA kernel whose splits merged inside a thread-block cluster (partials stored into one block's shared
memory, no atomics) matched it alone at 512 tokens, lost 1.6x at 4096 (its products off the tensor cores) and moved
whole steps by under 1%: removed (docs/results/history.md, session 22).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from tpserve.attention.page_table import TableMetadata
from tpserve.kernels.settings import int_settings
from tpserve.kernels.pdl import triton_pdl

CHUNK = 32  # tokens a program reads per step
PROGRAMS_PER_SM = 2  # splits fill the GPU this many (sequence, kv head, split) programs deep
MAX_SPLITS = 32  # programs per (sequence, kv head) at most (64 was slower at batch 1: experiment)
# ... and where a KV head serves WIDE_GROUP query heads or more (Qwen3's MoE models: 32 or 64 to 4). Whole batch-1
# steps of Qwen3-30B-A3B on an H200, against 32: 0.953x at context 512, 0.955x at 4096; Qwen3-8B (4 query heads a
# KV head) was slower with 16: 1.014x bf16, 1.02x FP8 (docs/benchmarks.md, session 20). At ~540 tokens 16 grid splits
# use 9 splits of 64 tokens where 32 use 17 of 32: half the partials for the last program to merge, GROUP rows each,
# against a second chunk per split; the wider the group, the more the merge weighs.
WIDE_GROUP_MAX_SPLITS = 16
WIDE_GROUP = 8
MERGE_UNROLL = 16  # splits the merge loads at once
# ``--decode-attention auto`` over bf16/fp16 pages on Hopper takes this kernel up to this batch size
# and FlashInfer's decode wrapper above it (docs/benchmarks.md, "Decode attention: tpserve's Triton kernel").
AUTO_MAX_BATCH = 32
# Experiments: the kernel's settings in an engine, e.g. ``chunk=16 max_splits=64 num_warps=2`` (read when
# the attention backend is built), so whole steps of several settings can be timed in one process.
CONFIG_ENV = "TPSERVE_TRITON_DECODE"
CONFIG_RANGES = {"chunk": (1, 1 << 16), "max_splits": (1, 1 << 16), "num_warps": (1, 32),
                 "merge_unroll": (1, 1 << 16), "prefetch": (0, 1)}


def config_from_env(setting: str | None = None) -> dict[str, int]:
    """``TPSERVE_TRITON_DECODE`` (or ``setting``) as ``TritonDecode`` keyword arguments; empty by default."""
    setting = os.environ.get(CONFIG_ENV, "") if setting is None else setting
    config = dict(int_settings(setting, CONFIG_ENV))
    for key, value in config.items():
        low, high = CONFIG_RANGES.get(key, (1, 0))  # an unknown name has an empty range
        if not low <= value <= high:
            raise ValueError(f"{CONFIG_ENV}: {key}={value} is not a setting: "
                             + ", ".join(f"{name} in {lo}..{hi}" for name, (lo, hi) in CONFIG_RANGES.items()))
    return config


@triton.jit
def _merge_splits(part_out_ptr, part_ml_ptr, out_ptr, first, splits, b, h, stride_ob, stride_oh,
                  GROUP: tl.constexpr, G_MERGE: tl.constexpr, HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr,
                  UNROLL: tl.constexpr):
    """Every split's max in one load, then UNROLL splits' partials a loop step, their loads issued
    together: each loop step waits one L2 round trip. (A plain loop over the splits waits one per
    split, and [splits, head_dim] tiles reduced across warps per query head were 3-8 us slower at
    8-16 splits on an H200: benchmarks/experiments/triton_decode_attention.py.)"""
    g = tl.arange(0, G_MERGE)  # the group's query heads to a power of two (not to tl.dot's 16 rows)
    d = tl.arange(0, HEAD_DIM)
    sp = tl.arange(0, MAX_SPLITS)
    real = g < GROUP
    both = (sp < splits)[:, None] & real[None, :]
    m = tl.load(part_ml_ptr + (first + sp[:, None] * GROUP + g[None, :]) * 2, mask=both, other=-float("inf"),
                cache_modifier=".cg")
    big_m = tl.max(m, axis=0)
    total = tl.zeros([G_MERGE], dtype=tl.float32)
    acc = tl.zeros([G_MERGE, HEAD_DIM], dtype=tl.float32)
    for base in range(0, splits, UNROLL):
        for j in tl.static_range(UNROLL):
            rows = first + (base + j) * GROUP + g
            live = real & (g * 0 + base + j < splits)
            m_j = tl.load(part_ml_ptr + rows * 2, mask=live, other=-float("inf"), cache_modifier=".cg")
            weight = tl.where(live, tl.exp2(m_j - big_m), 0.0)
            total += weight * tl.load(part_ml_ptr + rows * 2 + 1, mask=live, other=0.0, cache_modifier=".cg")
            o_j = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0,
                          cache_modifier=".cg")
            acc += o_j * weight[:, None]
    out_rows = out_ptr + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh + d[None, :]
    tl.store(out_rows, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=real[:, None])


@triton.jit
def _tanh(x):
    """tanh from exp2 (Triton has no tanh the CPU interpreter runs): e^(-2|x|) is at most 1, so nothing overflows."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend_chunk(q, k, v, ok, big_m, total, acc, qk_scale, cap_log2, IEEE: tl.constexpr, SOFTCAP: tl.constexpr):
    """One chunk of the online softmax: the running max, sum and output after the tokens ``ok``. The softmax runs in
    base 2: the scores times ``qk_scale``, scale * log2(e); with SOFTCAP, scale / cap, whose tanh is then times
    ``cap_log2``, cap * log2(e) (FlashInfer's split of the soft-cap)."""
    if IEEE:  # float32 (the CPU check under TRITON_INTERPRET=1)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = scores * qk_scale
    if SOFTCAP:
        scores = _tanh(scores) * cap_log2
    scores = tl.where(ok[None, :], scores, -float("inf"))
    new_m = tl.maximum(big_m, tl.max(scores, axis=1))
    p = tl.exp2(scores - new_m[:, None])
    alpha = tl.exp2(big_m - new_m)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return new_m, total * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_out_ptr, part_ml_ptr, counter_ptr, out_ptr, qk_scale, cap_log2,
    window, fresh, stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, G_MERGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, CHUNK: tl.constexpr, MAX_SPLITS: tl.constexpr, MERGE_UNROLL: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, SOFTCAP: tl.constexpr,
):
    if PDL:  # the next kernel (the o projection's GEMV) may launch and load its weights meanwhile
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    grid_splits = tl.num_programs(2)  # a launch argument, so one compiled kernel serves every batch size
    seq_len = tl.load(lens_ptr + b)  # lengths and page table: the host's, no kernel writes them
    # a sliding window (window > 0) attends to the newest token and the window - 1 before it: keys from lo on
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len - lo, grid_splits), CHUNK), 1) * CHUNK
    splits = tl.cdiv(seq_len - lo, per_split)
    if s < splits:
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HEAD_DIM)
        real = (g < GROUP)[:, None]
        t_end = tl.minimum(seq_len, lo + (s + 1) * per_split)
        big_m = tl.full([G_PAD], -float("inf"), tl.float32)
        total = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
        start = lo + s * per_split
        offs = start + tl.arange(0, CHUNK)
        page = tl.load(table_ptr + b * stride_tb + offs // PAGE, mask=offs < t_end, other=0)
        if PREFETCH:  # the first chunk's k and v before the wait: only the newest `fresh` tokens' are this step's
            ok = offs < t_end
            rows = (page.to(tl.int64) * stride_kp + (offs % PAGE) * stride_ks + h * stride_kh)[:, None] + d[None, :]
            older = (offs < tl.minimum(t_end, seq_len - fresh))[:, None]
            k = tl.load(k_ptr + rows, mask=older, other=0.0)
            v = tl.load(v_ptr + rows, mask=older, other=0.0)
        if PDL:  # q and the newest tokens' k and v: written by the previous kernel
            tl.extra.cuda.gdc_wait()
        q_rows = q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :]
        q = tl.load(q_rows, mask=real, other=0.0)
        if PREFETCH:
            newest = ((offs >= seq_len - fresh) & ok)[:, None]  # later chunks are read after the wait anyway
            k = tl.where(newest, tl.load(k_ptr + rows, mask=newest, other=0.0), k)
            v = tl.where(newest, tl.load(v_ptr + rows, mask=newest, other=0.0), v)
            offs += CHUNK
            page = tl.load(table_ptr + b * stride_tb + offs // PAGE, mask=offs < t_end, other=0)
            big_m, total, acc = _attend_chunk(q, k, v, ok, big_m, total, acc, qk_scale, cap_log2, IEEE,
                                              SOFTCAP)
            start += CHUNK
        for t in range(start, t_end, CHUNK):
            ok = offs < t_end
            rows = (page.to(tl.int64) * stride_kp + (offs % PAGE) * stride_ks + h * stride_kh)[:, None] + d[None, :]
            k = tl.load(k_ptr + rows, mask=ok[:, None], other=0.0)
            v = tl.load(v_ptr + rows, mask=ok[:, None], other=0.0)
            # The next step's page ids, issued before this step's math (they lead its loads).
            offs += CHUNK
            page = tl.load(table_ptr + b * stride_tb + offs // PAGE, mask=offs < t_end, other=0)
            big_m, total, acc = _attend_chunk(q, k, v, ok, big_m, total, acc, qk_scale, cap_log2, IEEE,
                                              SOFTCAP)
        out_rows = out_ptr + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh + d[None, :]
        if splits == 1:
            tl.store(out_rows, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=real)
        else:
            first = (b * KV_HEADS + h) * grid_splits * GROUP
            part = first + s * GROUP + g
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=real)
            tl.store(part_ml_ptr + part * 2, big_m, mask=g < GROUP)
            tl.store(part_ml_ptr + part * 2 + 1, total, mask=g < GROUP)
            tl.debug_barrier()  # every thread's partials are written before the release below
            counter = counter_ptr + b * KV_HEADS + h
            if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
                _merge_splits(part_out_ptr, part_ml_ptr, out_ptr, first, splits, b, h, stride_ob, stride_oh,
                              GROUP, G_MERGE, HEAD_DIM, MAX_SPLITS, MERGE_UNROLL)
                tl.store(counter, 0)


def splits_for(batch: int, num_kv_heads: int, sm_count: int, max_splits: int = MAX_SPLITS) -> int:
    """Programs per (sequence, kv head): enough for PROGRAMS_PER_SM programs per SM (a power of
    two, at least 2 so that long sequences still split at large batches)."""
    wanted = -(-PROGRAMS_PER_SM * sm_count // (batch * num_kv_heads))
    return max(2, min(max_splits, triton.next_power_of_2(wanted)))


def unsupported_reason(head_dim: int, num_heads: int, num_kv_heads: int, fp8_cache: bool) -> str | None:
    """Why the kernel cannot take this cache layout, or None when it can."""
    if fp8_cache:
        return "the Triton decode kernel reads bfloat16/float16 pages, not FP8 (XQA does)"
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        return f"the Triton decode kernel takes a power-of-two head_dim from 16 to 256, not {head_dim}"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads do not group over {num_kv_heads} KV heads"
    return None


class TritonDecode:
    """The kernel over one engine's cache, with its merge counters (zero between calls)."""

    name = "Triton's split-KV"

    def __init__(self, num_heads: int, num_kv_heads: int, scale: float, device: torch.device,
                 max_batch: int = 4096, chunk: int = CHUNK, max_splits: int | None = None, num_warps: int = 4,
                 merge_unroll: int = MERGE_UNROLL, prefetch: int = 1, softcap: float | None = None,
                 fresh_tokens: int = 1) -> None:
        """``softcap``: each score (after ``scale``) becomes softcap * tanh(score / softcap) (None: none).
        ``fresh_tokens``: how many of a row's newest keys its step writes (1; more where a drafted step runs a row a
        token, whose earlier rows' keys are this step's too): the prefetch reads those again after the wait."""
        if max_splits is None:
            max_splits = WIDE_GROUP_MAX_SPLITS if num_heads // num_kv_heads >= WIDE_GROUP else MAX_SPLITS
        if max_splits & (max_splits - 1) or chunk & (chunk - 1):
            raise ValueError(f"max_splits and chunk must be powers of two, not {max_splits} and {chunk}")
        self.group = num_heads // num_kv_heads
        self.g_merge = triton.next_power_of_2(self.group)  # the merge's rows: the group unpadded
        self.g_pad = max(16, self.g_merge)  # the split programs' rows: tl.dot takes 16 at least
        self.num_kv_heads = num_kv_heads
        # the kernel's softmax runs in base 2 (_attend_chunk): log2(e) with the scale, or after a soft-cap's tanh
        self.softcap = softcap
        self.qk_scale = scale * math.log2(math.e) if softcap is None else scale / softcap
        self.cap_log2 = 0.0 if softcap is None else softcap * math.log2(math.e)
        self.chunk, self.max_splits, self.num_warps, self.merge_unroll = chunk, max_splits, num_warps, merge_unroll
        # 1: each program reads its first chunk's k and v before it waits on the previous kernel, so those
        # loads are out before the o GEMV's weight prefetch fills the memory system. Whole batch-1 steps on an
        # H200: 0.969x at context 512 for Qwen3-30B-A3B, 0.993x for Qwen3-8B (docs/benchmarks.md, session 14)
        self.prefetch = bool(prefetch)
        if fresh_tokens < 1:
            raise ValueError(f"fresh_tokens must be at least 1, got {fresh_tokens}")
        self.fresh_tokens = fresh_tokens
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 32
        self.counters = torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=device)
        self._retired: list[torch.Tensor] = []  # smaller counters that captured graphs may still use

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TableMetadata,
            window: int = 0) -> torch.Tensor:
        """out [B, Hq, D] of q [B, Hq, D] over the caches [pages, page_size, Hkv, D]; ``window`` > 0: each sequence's
        newest token attends to itself and the window - 1 tokens before it."""
        batch, _, head_dim = q.shape
        q = q.contiguous()
        if batch * self.num_kv_heads > self.counters.numel():
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("capture CUDA graphs largest batch first (the merge counters are shared)")
            self._retired.append(self.counters)
            self.counters = torch.zeros(batch * self.num_kv_heads, dtype=torch.int32, device=q.device)
        splits = splits_for(batch, self.num_kv_heads, self.sm_count, self.max_splits)
        rows = batch * self.num_kv_heads * splits * self.group
        part_out = torch.empty(rows, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(rows, 2, dtype=torch.float32, device=q.device)
        out = torch.empty_like(q)
        pdl = triton_pdl(q.device, batch)
        _decode_kernel[(batch, self.num_kv_heads, splits)](
            q, k_cache, v_cache, meta.page_table, meta.seq_lens, part_out, part_ml, self.counters, out,
            self.qk_scale, self.cap_log2, window, self.fresh_tokens, q.stride(0), q.stride(1), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), meta.page_table.stride(0), out.stride(0), out.stride(1),
            KV_HEADS=self.num_kv_heads, GROUP=self.group, G_PAD=self.g_pad, G_MERGE=self.g_merge,
            HEAD_DIM=head_dim, PAGE=k_cache.shape[1], CHUNK=self.chunk, MAX_SPLITS=self.max_splits,
            MERGE_UNROLL=self.merge_unroll, IEEE=q.dtype == torch.float32, PDL=pdl, PREFETCH=self.prefetch,
            SOFTCAP=self.softcap is not None,
            num_warps=self.num_warps,
            launch_pdl=pdl,
        )
        return out
