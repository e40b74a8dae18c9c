"""tpserve's Triton split-KV decode attention (``attention/triton_decode.py``) at several settings
(tokens a step, most splits, warps, splits merged a loop step) against FlashInfer's decode wrapper, the kernels alone.

    python benchmarks/experiments/triton_decode_attention.py --heads 32:8,32:4,64:8 --batch-sizes 1,8,32 \
        --contexts 512,4096,16384 --settings 32:64:4:16,32:32:4:16 --out out/triton_decode_attention.json

Timing: each variant runs REPS times in one CUDA graph, each run after a zeroing of --flush-mib
(L2 cold, as in a model step); the profiler's kernel timeline gives each run's span, first
attention kernel's start to last one's end (the in-graph cost, without the graph's launch).
The kernel's correctness checks are tests/attention/test_triton_decode.py.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from itertools import product

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from common import print_table, trace_kernels, write_json  # noqa: E402
from tpserve.attention.page_table import TableMetadata  # noqa: E402
from tpserve.attention.triton_decode import TritonDecode  # noqa: E402


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
    """The runs to time at one point: FlashInfer's decode wrapper, then each Triton setting."""
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
    # The dense table as wide as a graph's (--table-pages), each row's pages at its start.
    table = torch.zeros(batch, max(args.table_pages, context // 16 + 1), dtype=torch.int32, device=q.device)
    for b in range(batch):
        pages = indices[indptr[b]:indptr[b + 1]]
        table[b, : pages.numel()] = pages
    lens = torch.full((batch,), context, dtype=torch.int32, device=q.device)
    scale = 1 / math.sqrt(q.shape[-1])
    for setting in args.settings.split(","):
        chunk, splits, warps, unroll = (int(x) for x in setting.split(":"))
        kernel = TritonDecode(q_heads, kv_heads, scale, q.device, max_batch=batch, chunk=chunk, max_splits=splits,
                              num_warps=warps, merge_unroll=unroll)
        meta = TableMetadata(kernel, table, lens)
        variants[f"t{setting}"] = lambda m=meta: m.attend(q, k_cache, v_cache)
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
    parser.add_argument("--heads", default="32:8,32:4,64:8", help="q:kv heads, comma-separated")
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--settings", default="32:64:4:16,32:32:4:16,32:16:4:16,32:64:4:8,32:64:4:32,64:64:4:16",
                        help="CHUNK:MAX_SPLITS:NUM_WARPS:MERGE_UNROLL of the Triton kernel, comma-separated; "
                        "a column tCHUNK:... each")
    parser.add_argument("--table-pages", type=int, default=2560, help="dense table width (a graph's: max_model_len/16)")
    parser.add_argument("--reps", type=int, default=20, help="runs per graph")
    parser.add_argument("--flush-mib", type=int, default=64, help="zeroed before each run (L2 cold)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    rows = benchmark(args)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    print("\nIn-graph span of one decode attention, us (L2 cold), median of", args.reps)
    print_table(rows, columns)
    write_json(args.out, {"benchmark": "triton_decode_attention", "device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
