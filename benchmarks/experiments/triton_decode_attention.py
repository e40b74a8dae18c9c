"""Decode attention at small batches as split-KV Triton kernels, against FlashInfer's decode wrapper.

Why: inside a batch-1 decode graph on an H200, FlashInfer's decode wrapper takes 8.5-9.3 us plus
2.3-2.5 us to merge its KV splits per layer for 1 MB of KV (Qwen3-8B, Qwen3-30B-A3B, context 512;
docs/benchmarks.md, "Where a batch-1 step goes"): a tenth of the A3B step, more than any kernel but
the GEMVs and experts. Reading 1 MB takes 0.25 us; the rest is latency.

The kernels (one query token per sequence, paged KV in tpserve's layout: k/v caches
[pages, page_size, kv_heads, head_dim], FlashInfer's CSR page table kv_indptr / kv_indices /
last_page_len):

- ``_split_kernel``, grid (batch, kv_heads, SPLITS): the GQA group's query heads (padded to 16 rows
  for ``tl.dot``) against a page-aligned SPLITS-th of the sequence, BLOCK_T tokens a step, online
  softmax; writes its partial output and (max, sum) in float32.
- ``_merge_kernel``, grid (batch, kv_heads): the SPLITS partials combined (two kernels), or with
  ``one_kernel`` the last split program of each (sequence, kv head) to finish merges them itself,
  found by an atomic counter that it then resets (one kernel, as CUDA-graph safe).

    python benchmarks/experiments/triton_decode_attention.py --heads 32:8,32:4,64:8 --batch-sizes 1,4,8 \
        --contexts 512,4096 --out out/triton_decode_attention.json
    TRITON_INTERPRET=1 python benchmarks/experiments/triton_decode_attention.py --check   # CPU, float32

Timing: each variant runs REPS times in one CUDA graph, each run after a zeroing of --flush-mib
(L2 cold, as in a model step); the profiler's kernel timeline gives each run's span, first
attention kernel's start to last one's end (the in-graph cost, without the graph's launch).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from itertools import product

import torch
import triton
import triton.language as tl


@triton.jit
def _merge(part_out_ptr, part_ml_ptr, out_ptr, b, h, stride_ob, stride_oh,
           KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
           SPLITS: tl.constexpr):
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, HEAD_DIM)
    first = (b * KV_HEADS + h) * SPLITS * G_PAD
    big_m = tl.full([G_PAD], -float("inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        big_m = tl.maximum(big_m, tl.load(part_ml_ptr + (first + s * G_PAD + g) * 2, cache_modifier=".cg"))
    total = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        rows = first + s * G_PAD + g
        weight = tl.exp(tl.load(part_ml_ptr + rows * 2, cache_modifier=".cg") - big_m)  # 0 for an empty split
        total += weight * tl.load(part_ml_ptr + rows * 2 + 1, cache_modifier=".cg")
        part = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + d[None, :], cache_modifier=".cg")
        acc += part * weight[:, None]
    out = acc / total[:, None]
    out_ptrs = out_ptr + b * stride_ob + (h * GROUP + g)[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, kv_indptr_ptr, kv_indices_ptr, last_len_ptr, part_out_ptr, part_ml_ptr, counter_ptr,
    out_ptr, sm_scale, stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_ob, stride_oh,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_T: tl.constexpr, ONE_KERNEL: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    first_page = tl.load(kv_indptr_ptr + b)
    seq_len = (tl.load(kv_indptr_ptr + b + 1) - first_page - 1) * PAGE + tl.load(last_len_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_T) * BLOCK_T
    t_start = s * per_split
    t_end = tl.minimum(seq_len, t_start + per_split)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=(g < GROUP)[:, None], other=0.0)
    big_m = tl.full([G_PAD], -float("inf"), tl.float32)
    total = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
    for t in range(t_start, t_end, BLOCK_T):
        offs = t + tl.arange(0, BLOCK_T)
        ok = offs < t_end
        page = tl.load(kv_indices_ptr + first_page + offs // PAGE, mask=ok, other=0).to(tl.int64)
        rows = page * stride_kp + (offs % PAGE) * stride_ks + h * stride_kh
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        else:
            scores = tl.dot(q, tl.trans(k)) * sm_scale
        scores = tl.where(ok[None, :], scores, -float("inf"))
        new_m = tl.maximum(big_m, tl.max(scores, axis=1))
        p = tl.exp(scores - new_m[:, None])
        alpha = tl.exp(big_m - new_m)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        total = total * alpha + tl.sum(p, axis=1)
        big_m = new_m
    rows = ((b * KV_HEADS + h) * SPLITS + s) * G_PAD + g
    tl.store(part_out_ptr + rows[:, None] * HEAD_DIM + d[None, :], acc)
    tl.store(part_ml_ptr + rows * 2, big_m)
    tl.store(part_ml_ptr + rows * 2 + 1, total)
    if ONE_KERNEL:
        finished = tl.atomic_add(counter_ptr + b * KV_HEADS + h, 1, sem="acq_rel")
        if finished == SPLITS - 1:
            _merge(part_out_ptr, part_ml_ptr, out_ptr, b, h, stride_ob, stride_oh,
                   KV_HEADS, GROUP, G_PAD, HEAD_DIM, SPLITS)
            tl.store(counter_ptr + b * KV_HEADS + h, 0)


@triton.jit
def _merge_kernel(part_out_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh,
                  KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  SPLITS: tl.constexpr):
    _merge(part_out_ptr, part_ml_ptr, out_ptr, tl.program_id(0), tl.program_id(1), stride_ob, stride_oh,
           KV_HEADS, GROUP, G_PAD, HEAD_DIM, SPLITS)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor, last_page_len: torch.Tensor, sm_scale: float, splits: int = 8,
    block_t: int = 32, one_kernel: bool = False, counter: torch.Tensor | None = None, num_warps: int = 4,
) -> torch.Tensor:
    """out [B, Hq, D] of q [B, Hq, D] over the paged caches [pages, page_size, Hkv, D]; ``counter``
    (int32 [B * Hkv], zeros) is the one-kernel merge's, kept zero between calls."""
    batch, q_heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    g_pad = max(16, triton.next_power_of_2(group))
    part_out = torch.empty(batch * kv_heads * splits * g_pad, head_dim, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch * kv_heads * splits * g_pad, 2, dtype=torch.float32, device=q.device)
    if counter is None:
        counter = torch.zeros(batch * kv_heads, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    _split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, last_page_len, part_out, part_ml, counter, out, sm_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        KV_HEADS=kv_heads, GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim, PAGE=page, SPLITS=splits, BLOCK_T=block_t,
        ONE_KERNEL=one_kernel, IEEE=q.dtype == torch.float32, num_warps=num_warps,
    )
    if not one_kernel:
        _merge_kernel[(batch, kv_heads)](
            part_out, part_ml, out, out.stride(0), out.stride(1),
            KV_HEADS=kv_heads, GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim, SPLITS=splits, num_warps=num_warps,
        )
    return out


def reference(q, k_cache, v_cache, kv_indptr, kv_indices, last_page_len, sm_scale) -> torch.Tensor:
    """float64 attention of each sequence over its gathered pages."""
    batch, q_heads, _ = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long().cpu()
        length = (len(pages) - 1) * page + int(last_page_len[b])
        k = k_cache.cpu()[pages].reshape(-1, kv_heads, k_cache.shape[3])[:length].double()
        v = v_cache.cpu()[pages].reshape(-1, kv_heads, v_cache.shape[3])[:length].double()
        k, v = (t.repeat_interleave(q_heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("hd,thd->ht", q[b].cpu().double(), k) * sm_scale
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v)
    return out


def paged_inputs(batch: int, q_heads: int, kv_heads: int, lengths: list[int], pool_pages: int, dtype, device,
                 seed: int, page: int = 16, head_dim: int = 128):
    """q, caches and a CSR page table with every sequence's pages scattered over the pool."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, head_dim, generator=gen).to(dtype).to(device)
    k_cache = torch.randn(pool_pages, page, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(pool_pages, page, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    counts = [-(-n // page) for n in lengths]
    indices = torch.randperm(pool_pages, generator=gen)[: sum(counts)].to(torch.int32)
    indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    last = torch.tensor([n - (c - 1) * page for n, c in zip(lengths, counts)], dtype=torch.int32)
    return q, k_cache, v_cache, indptr.to(device), indices.to(device), last.to(device)


def check() -> None:
    """float32 on the CPU (TRITON_INTERPRET=1) against float64: GQA groups 1 to 8 and 5, lengths off
    the page and block grid, more splits than pages (empty splits), both merges, the counter reset."""
    cases = [  # (q heads, kv heads, lengths, splits, block_t)
        (4, 4, [1], 4, 16), (8, 2, [37, 5], 4, 32), (8, 1, [100], 8, 16), (10, 2, [16, 33, 70], 2, 32),
        (16, 2, [300], 16, 16),
    ]
    for i, (q_heads, kv_heads, lengths, splits, block_t) in enumerate(cases):
        inputs = paged_inputs(len(lengths), q_heads, kv_heads, lengths, 40, torch.float32, "cpu", seed=i)
        expected = reference(*inputs, sm_scale=0.125)
        for one_kernel in (False, True):
            counter = torch.zeros(len(lengths) * kv_heads, dtype=torch.int32)
            got = decode_attention(*inputs, 0.125, splits, block_t, one_kernel, counter)
            err = float((got.double() - expected).abs().max())
            assert err < 1e-5, f"case {i} one_kernel={one_kernel}: max error {err:.2e}"
            assert not counter.any(), f"case {i}: the counter was not reset"
    # bf16 as the GPU runs it: the interpreter's bf16 dots are not exact, so this run only records
    # the launches that tests/benchmarks/test_triton_decode_attention.py compiles for Hopper.
    bf16 = paged_inputs(1, 32, 4, [40], 8, torch.bfloat16, "cpu", seed=9)
    for one_kernel in (False, True):
        decode_attention(*bf16, 0.125, 8, 32, one_kernel)
    print("ok")


def kernel_spans(run, reps: int, flush: torch.Tensor) -> list[float]:
    """Each of ``reps`` runs in one CUDA graph, after a flush: its kernels' span in us."""
    from torch.profiler import ProfilerActivity, profile

    def body():
        for _ in range(reps):
            flush.zero_()
            run()

    body()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    from common import trace_kernels

    return spans_between_flushes(trace_kernels(prof))


def spans_between_flushes(events: list[dict]) -> list[float]:
    """The span (first start to last end) of the kernels between consecutive flushes (torch's fill
    kernels; not FlashInfer's BatchPrefill..., whose name has "fill" too), from time-sorted trace
    events with ``name``, ``ts`` and ``dur``."""
    spans, current = [], []
    for event in events + [None]:
        if event is None or "elementwise" in event["name"] or "FillFunctor" in event["name"]:
            if current:
                spans.append(max(e["ts"] + e["dur"] for e in current) - current[0]["ts"])
            current = []
        else:
            current.append(event)
    return spans


def point_variants(args: argparse.Namespace, workspace: torch.Tensor, q_heads: int, kv_heads: int, batch: int,
                   context: int) -> dict:
    """The runs to time at one point: FlashInfer's decode wrapper, then each Triton variant."""
    import flashinfer

    pool = batch * (context // 16 + 1) * 2
    q, k_cache, v_cache, indptr, indices, last = paged_inputs(
        batch, q_heads, kv_heads, [context] * batch, pool, torch.bfloat16, workspace.device, 7)
    # As tpserve's captured decode wrappers: fixed index buffers, tensor cores from GQA 4.
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=q_heads // kv_heads >= 4, use_cuda_graph=True,
        paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
        paged_kv_last_page_len_buffer=last.clone())
    wrapper.plan(indptr.cpu(), indices.cpu(), last.cpu(), q_heads, kv_heads, 128, 16, q_data_type=torch.bfloat16)
    variants = {"flashinfer": lambda: wrapper.run(q, (k_cache, v_cache))}
    scale = 1 / math.sqrt(q.shape[-1])
    for splits, one in product([int(x) for x in args.splits.split(",")], (False, True)):
        counter = torch.zeros(batch * kv_heads, dtype=torch.int32, device=q.device)
        variants[f"triton_s{splits}{'_one' if one else ''}"] = lambda s=splits, o=one, c=counter: decode_attention(
            q, k_cache, v_cache, indptr, indices, last, scale, s, args.block_t, o, c)
    return variants


def benchmark(args: argparse.Namespace) -> list[dict]:
    device = torch.device("cuda")
    flush = torch.empty(args.flush_mib * 2**20 // 4, dtype=torch.float32, device=device)
    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    rows = []
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    for heads, batch, context in product(args.heads.split(","), ints(args.batch_sizes), ints(args.contexts)):
        q_heads, kv_heads = (int(x) for x in heads.split(":"))
        variants = point_variants(args, workspace, q_heads, kv_heads, batch, context)
        expected = variants["flashinfer"]()
        row = {"heads": heads, "batch": batch, "context": context}
        for name, run in variants.items():
            try:
                diff = float((run().float() - expected.float()).abs().max())
                span = statistics.median(kernel_spans(run, args.reps, flush))
            except Exception as exc:  # noqa: BLE001 -- reported in the table, the others still run
                row[name] = f"{type(exc).__name__}: {exc}"[:80]
                continue
            row[name] = round(span, 2) if diff <= 2e-2 else f"{span:.2f} WRONG (max diff {diff:.3f})"
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="the CPU check (run with TRITON_INTERPRET=1)")
    parser.add_argument("--heads", default="32:8,32:4,64:8", help="q:kv heads, comma-separated")
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--splits", default="4,8,16", help="KV splits per (sequence, kv head)")
    parser.add_argument("--block-t", type=int, default=32, help="tokens per step of a split")
    parser.add_argument("--reps", type=int, default=20, help="runs per graph")
    parser.add_argument("--flush-mib", type=int, default=64, help="zeroed before each run (L2 cold)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.check:
        check()
        return
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --check with TRITON_INTERPRET=1)")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/common.py
    rows = benchmark(args)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    from common import print_table, write_json

    print("\nIn-graph span of one decode attention, us (L2 cold), median of", args.reps)
    print_table(rows, columns)
    write_json(args.out, {"benchmark": "triton_decode_attention", "device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
