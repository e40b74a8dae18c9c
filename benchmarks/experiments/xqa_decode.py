"""Decode attention alone: FlashInfer's paged decode wrapper (as tpserve plans it) against the
XQA kernel (``flashinfer.decode.trtllm_batch_decode_with_kv_cache(backend="xqa")``, TensorRT-LLM's
decode kernel; on sm90 with an FP8 cache it runs the Hopper FP8 kernel), bf16 and FP8 e4m3 KV.

Every point attends one query token per sequence to ``context`` cached tokens (head_dim 128)
whose pages are a random sample of a shared pool. Both kernels run as CUDA-graph replays with
L2 evicted before each replay (a step reads every layer's KV cold), timed by CUDA events
(median of --iters). Each output is checked against fp32 torch attention over the same cache
(an FP8 cache read back as stored) on the first sequences; the table's err columns are that
max abs error. KV bytes per point: batch * context * kv_heads * 128 * 2 (K and V) * element size.

    python benchmarks/experiments/xqa_decode.py --heads 16:8,32:8,64:8 --batch-sizes 1,64,256 \
        --contexts 512,2048 --kv-dtypes bf16,fp8 --out out/xqa_decode.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for benchmarks/common.py
from attention_decode import capture, measure  # this directory's: timing with L2 evicted, graph capture
from common import copy_bandwidth, device_name, print_table, write_json

ITERS_WARMUP = 3

HEAD_DIM = 128
CHECK_SEQS = 4
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
XQA_SEMAPHORE_BYTES = 8 * 2**20  # the first 8 MiB of XQA's workspace, as flashinfer.decode splits it


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, context: int) -> torch.Tensor:
    group = q.shape[1] // k_pool.shape[2]
    outs = []
    for i in range(min(q.shape[0], CHECK_SEQS)):
        pages = table[i].long()
        k = k_pool[pages].float().reshape(-1, k_pool.shape[2], HEAD_DIM)[:context].repeat_interleave(group, dim=1)
        v = v_pool[pages].float().reshape(-1, v_pool.shape[2], HEAD_DIM)[:context].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].float(), k) / math.sqrt(HEAD_DIM)
        outs.append(torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v))
    return torch.stack(outs)


def run_point(fi, args, q_heads: int, kv_heads: int, batch: int, context: int, kv_name: str, pools, buffers) -> dict:
    k_pool, v_pool = pools
    workspace, xqa_workspace, flush = buffers
    device = k_pool.device
    page_size = args.page_size
    pages = -(-context // page_size)
    gen = torch.Generator().manual_seed(batch * 100003 + context * 7 + q_heads)
    table = torch.randperm(k_pool.shape[0] - 1, generator=gen)[: batch * pages].add(1).to(torch.int32).view(batch, pages)
    q = torch.randn(batch, q_heads, HEAD_DIM, generator=gen).to(device=device, dtype=torch.bfloat16)
    table_gpu = table.to(device)
    ref = reference(q, k_pool, v_pool, table_gpu, context)
    kv_bytes = batch * context * kv_heads * HEAD_DIM * 2 * k_pool.element_size()
    row = {"heads": f"{q_heads}:{kv_heads}", "batch": batch, "ctx": context, "kv": kv_name, "MB": round(kv_bytes / 1e6, 1)}

    # FlashInfer's decode wrapper as tpserve captures it (tensor cores from 4 query heads per KV head).
    try:
        tensor_cores = q_heads // kv_heads >= 4
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=torch.arange(batch + 1, dtype=torch.int32, device=device) * pages,
            paged_kv_indices_buffer=table_gpu.flatten().clone(),
            paged_kv_last_page_len_buffer=torch.full((batch,), context - (pages - 1) * page_size, dtype=torch.int32, device=device),
        )
        wrapper.plan(
            torch.arange(batch + 1, dtype=torch.int32) * pages,
            table.flatten(),
            torch.full((batch,), context - (pages - 1) * page_size, dtype=torch.int32),
            q_heads,
            kv_heads,
            HEAD_DIM,
            page_size,
            sm_scale=1 / math.sqrt(HEAD_DIM),
            q_data_type=torch.bfloat16,
            kv_data_type=k_pool.dtype,
        )
        out_fi = torch.empty_like(q)
        graph = capture(lambda: wrapper.run(q, (k_pool, v_pool), out=out_fi))
        row["fi_us"] = measure(graph.replay, ITERS_WARMUP, args.iters, flush) * 1e6
        row["fi_err"] = (out_fi[: ref.shape[0]].float() - ref).abs().max().item()
    except Exception as exc:  # noqa: BLE001 -- report and go on
        row["fi_us"], row["fi_err"] = float("nan"), float("nan")
        print(f"flashinfer failed at {row}: {type(exc).__name__}: {str(exc)[:300]}")

    try:
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        out_xqa = torch.empty_like(q)
        # As the engine's CUDA graphs pass it: a table as wide as --table-pages, the rest page 0.
        xqa_table = torch.zeros(batch, max(pages, args.table_pages), dtype=torch.int32, device=device)
        xqa_table[:, :pages] = table_gpu
        row["table"] = xqa_table.shape[1]

        def xqa() -> None:
            fi.decode.trtllm_batch_decode_with_kv_cache(
                q,
                (k_pool, v_pool),
                xqa_workspace,
                xqa_table,
                seq_lens,
                xqa_table.shape[1] * page_size,
                bmm1_scale=1 / math.sqrt(HEAD_DIM),
                bmm2_scale=1.0,
                out=out_xqa,
                kv_layout="NHD",
                backend="xqa",
            )

        graph = capture(xqa)
        row["xqa_us"] = measure(graph.replay, ITERS_WARMUP, args.iters, flush) * 1e6
        row["xqa_err"] = (out_xqa[: ref.shape[0]].float() - ref).abs().max().item()
    except Exception as exc:  # noqa: BLE001
        row["xqa_us"], row["xqa_err"] = float("nan"), float("nan")
        print(f"xqa failed at {row}: {type(exc).__name__}: {str(exc)[:300]}")
        traceback.print_exc(limit=3)

    row["xqa/fi"] = row["xqa_us"] / row["fi_us"]
    row["fi_TB/s"] = kv_bytes / row["fi_us"] / 1e6
    row["xqa_TB/s"] = kv_bytes / row["xqa_us"] / 1e6
    return row


def prebuild(heads: list[tuple[int, int]], kv_dtypes: list[torch.dtype], page_size: int) -> None:
    """JIT-build every XQA module the points need, in parallel (each is a separate nvcc build)."""
    from concurrent.futures import ThreadPoolExecutor

    from flashinfer.jit.xqa import gen_xqa_module

    specs = [
        gen_xqa_module(torch.bfloat16, kv, page_size, HEAD_DIM, q // k, False, torch.bfloat16)
        for q, k in heads
        for kv in kv_dtypes
    ]
    with ThreadPoolExecutor(len(specs)) as pool:
        list(pool.map(lambda spec: spec.build(), specs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="16:8,32:8,64:8", help="query:kv head counts, comma separated")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--kv-dtypes", default="bf16,fp8")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--table-pages", type=int, default=0,
                        help="give XQA a page table at least this wide (the engine's graphs: max_model_len / page size)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import flashinfer as fi
    import flashinfer.decode  # noqa: F401 -- trtllm_batch_decode_with_kv_cache

    device = torch.device("cuda")
    head_pairs = [tuple(int(h) for h in heads.split(":")) for heads in args.heads.split(",")]
    kv_names = args.kv_dtypes.split(",")
    prebuild(head_pairs, [KV_DTYPES[k] for k in kv_names], args.page_size)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    pool_pages = max(batches) * -(-max(contexts) // args.page_size) + 1
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=device)
    xqa_workspace = torch.zeros(XQA_SEMAPHORE_BYTES + 256 * 2**20, dtype=torch.uint8, device=device)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    rows = []
    for q_heads, kv_heads in head_pairs:
        shape = (pool_pages, args.page_size, kv_heads, HEAD_DIM)
        base = (torch.randn(shape, device=device, dtype=torch.bfloat16), torch.randn(shape, device=device, dtype=torch.bfloat16))
        for kv_name in kv_names:
            pools = tuple(t.to(KV_DTYPES[kv_name]) for t in base)
            for batch in batches:
                for context in contexts:
                    row = run_point(fi, args, q_heads, kv_heads, batch, context, kv_name, pools, (workspace, xqa_workspace, flush))
                    print(row, flush=True)
                    rows.append(row)
            del pools
    bandwidth = copy_bandwidth()
    write_json(args.out, {"benchmark": "xqa_decode", "gpu": device_name(), "copy_TB/s": bandwidth / 1e12, "rows": rows})
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print_table(rows, ["heads", "batch", "ctx", "kv", "table", "MB", "fi_us", "xqa_us", "xqa/fi", "fi_TB/s", "xqa_TB/s", "fi_err", "xqa_err"])


if __name__ == "__main__":
    main()
