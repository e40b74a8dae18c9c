"""Decode attention alone: FlashInfer's decode and prefill wrappers on one paged bf16 KV cache.

Every variant attends one query token per sequence to ``context`` cached tokens (head_dim 128):

  decode_cuda_cores            BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=False)
  decode_tensor_cores          BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True), fa2 kernel
  prefill_fa2, prefill_fa3     BatchPrefillWithPagedKVCacheWrapper(backend=...), one query per
                               sequence (qo_indptr = arange(B + 1)), causal=False
  decode_tensor_cores_nosplit  tensor-core decode planned with disable_split_kv=True
  decode_tensor_cores_fa3      BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, backend="fa3")
  by name only: prefill_fa2_nosplit, decode_tensor_cores_split<N> (fixed_split_size=N pages)

Variants run one after another over all points, decode_cuda_cores first: its outputs are the
reference every other variant is checked against (max abs diff, flagged above --tol; NaN counts
as a mismatch); all are also checked against an fp32 torch attention on the first sequences.
At each (heads, batch, context) point a variant is planned once and run() is timed with CUDA
events (median of --iters after --warmup), eagerly and as the replay of a CUDA graph captured on
a use_cuda_graph wrapper with fixed buffers. A sequence's pages are a random sample of a pool
sized for the largest point, so reads scatter as in a served cache. Before each timed run a
--flush-mib buffer is zeroed: that evicts L2 (in a model step every layer's KV is cold) and keeps
the GPU busy while the host enqueues the run, so the time is the kernels' own; with
--flush-mib 0 the runs are timed back to back with the host launch included (common.time_cuda).
KV bytes per point: batch * context * kv_heads * 128 * 2 bytes * 2 (K and V). A variant that
raises (unsupported option, failed JIT build) is reported and skipped. The first call of each
variant (wrapper, plan, run) is timed separately: it includes loading or JIT-building kernels.

    python benchmarks/experiments/attention_decode.py --heads 16:8,32:8,40:8 --batch-sizes 1,64,256 \
        --contexts 512,1024,4096 --out out/attention_decode.json
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import product

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for benchmarks/common.py
from common import copy_bandwidth, device_name, print_table, time_cuda, write_json

HEAD_DIM = 128
LAYOUT = ["NHD"]  # set from --layout in main(); read by the wrapper builders and the reference
DTYPE = torch.bfloat16
# Split-kv partial results, one buffer shared by every wrapper (as in tpserve).
WORKSPACE_BYTES = 256 * 2**20
REFERENCE = "decode_cuda_cores"
TORCH_CHECK_SEQS = 4  # sequences per point also checked against fp32 torch attention


@dataclass(frozen=True)
class Variant:
    name: str
    short: str  # column name in the summary
    wrapper: str  # "decode" or "prefill"
    tensor_cores: bool = False  # decode wrapper only
    backend: str | None = None  # the wrapper's ``backend`` argument, when set
    plan_kwargs: tuple[tuple[str, object], ...] = ()


NAMED = {
    v.name: v
    for v in (
        Variant("decode_cuda_cores", "dec_cc", "decode"),
        Variant("decode_tensor_cores", "dec_tc", "decode", tensor_cores=True),
        Variant("prefill_fa2", "pf_fa2", "prefill", backend="fa2"),
        Variant("prefill_fa3", "pf_fa3", "prefill", backend="fa3"),
        Variant(
            "decode_tensor_cores_nosplit",
            "dec_tc_nosplit",
            "decode",
            tensor_cores=True,
            plan_kwargs=(("disable_split_kv", True),),
        ),
        Variant(
            "decode_tensor_cores_fa3",
            "dec_tc_fa3",
            "decode",
            tensor_cores=True,
            backend="fa3",
        ),
        Variant(
            "prefill_fa2_nosplit",
            "pf_fa2_nosplit",
            "prefill",
            backend="fa2",
            plan_kwargs=(("disable_split_kv", True),),
        ),
    )
}
DEFAULT_VARIANTS = (
    "decode_cuda_cores,decode_tensor_cores,prefill_fa2,prefill_fa3,"
    "decode_tensor_cores_nosplit,decode_tensor_cores_fa3"
)


def variant_named(name: str) -> Variant:
    if name in NAMED:
        return NAMED[name]
    match = re.fullmatch(r"decode_tensor_cores_split(\d+)", name)
    if match:
        pages = int(match.group(1))
        return Variant(
            name,
            f"dec_tc_s{pages}",
            "decode",
            tensor_cores=True,
            plan_kwargs=(("fixed_split_size", pages),),
        )
    raise ValueError(
        f"unknown variant {name!r}; known: {', '.join(NAMED)}, decode_tensor_cores_split<N>"
    )


@dataclass
class Point:
    q_heads: int
    kv_heads: int
    batch: int
    context: int
    q: torch.Tensor  # [batch, q_heads, HEAD_DIM] on the GPU
    qo_indptr: torch.Tensor  # host int32 [batch + 1]: one query row per sequence
    kv_indptr: torch.Tensor  # host int32 [batch + 1]
    kv_indices: torch.Tensor  # host int32 page ids
    last_page_len: torch.Tensor  # host int32 [batch]
    reference: torch.Tensor | None = None  # decode_cuda_cores' eager output
    torch_reference: torch.Tensor | None = None  # fp32 attention of the first sequences

    @property
    def heads(self) -> str:
        return f"{self.q_heads}:{self.kv_heads}"

    @property
    def label(self) -> str:
        return f"heads {self.heads} batch {self.batch} ctx {self.context}"

    @property
    def kv_bytes(self) -> int:
        return self.batch * self.context * self.kv_heads * HEAD_DIM * DTYPE.itemsize * 2


class CudaBroken(RuntimeError):
    """The CUDA context no longer works (e.g. after an illegal memory access): stop measuring."""


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def head_configs(text: str) -> list[tuple[int, int]]:
    configs = []
    for item in text.split(","):
        q_heads, kv_heads = (int(x) for x in item.split(":"))
        if q_heads % kv_heads:
            raise ValueError(
                f"q heads {q_heads} are not a multiple of kv heads {kv_heads}"
            )
        configs.append((q_heads, kv_heads))
    return configs


def short_error(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cuda_ok() -> bool:
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except Exception:  # noqa: BLE001 -- any failure here means the context is gone
        return False


def make_points(
    heads: list[tuple[int, int]],
    batches: list[int],
    contexts: list[int],
    page_size: int,
    pool_pages: int,
    device: torch.device,
) -> list[Point]:
    points = []
    for i, ((q_heads, kv_heads), batch, context) in enumerate(
        product(heads, batches, contexts)
    ):
        gen = torch.Generator().manual_seed(1000 + i)
        pages = -(-context // page_size)
        # A random sample of the pool: every sequence's pages are scattered, none contiguous.
        indices = torch.randperm(pool_pages, generator=gen)[: batch * pages].to(
            torch.int32
        )
        points.append(
            Point(
                q_heads=q_heads,
                kv_heads=kv_heads,
                batch=batch,
                context=context,
                q=torch.randn(batch, q_heads, HEAD_DIM, generator=gen).to(
                    device=device, dtype=DTYPE
                ),
                qo_indptr=torch.arange(batch + 1, dtype=torch.int32),
                kv_indptr=torch.arange(batch + 1, dtype=torch.int32) * pages,
                kv_indices=indices,
                last_page_len=torch.full(
                    (batch,), context - (pages - 1) * page_size, dtype=torch.int32
                ),
            )
        )
    return points


def torch_attention(
    point: Point, k_pool: torch.Tensor, v_pool: torch.Tensor
) -> torch.Tensor:
    """fp32 attention of the point's first sequences, gathered through the page table."""
    group = point.q_heads // point.kv_heads  # query head h reads kv head h // group
    outs = []
    for i in range(min(point.batch, TORCH_CHECK_SEQS)):
        start, end = int(point.kv_indptr[i]), int(point.kv_indptr[i + 1])
        pages = point.kv_indices[start:end].to(device=k_pool.device, dtype=torch.long)
        k, v = k_pool[pages], v_pool[pages]
        if LAYOUT[0] == "HND":  # [pages, heads, page_size, dim] -> [pages, page_size, heads, dim]
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        k = k.reshape(-1, point.kv_heads, HEAD_DIM)[: point.context].float()
        v = v.reshape(-1, point.kv_heads, HEAD_DIM)[: point.context].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", point.q[i].float(), k) / math.sqrt(HEAD_DIM)
        outs.append(torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v))
    return torch.stack(outs)


def make_wrapper(
    fi,
    variant: Variant,
    workspace: torch.Tensor,
    graph_batch: int | None,
    max_pages: int,
):
    """An eager wrapper (graph_batch None), or a use_cuda_graph one for a fixed batch size whose
    index buffers keep their size and address (as tpserve's captured decode wrappers)."""
    device = workspace.device
    kwargs: dict[str, object] = {}
    if variant.backend is not None:
        kwargs["backend"] = variant.backend
    if variant.wrapper == "decode":
        kwargs["use_tensor_cores"] = variant.tensor_cores
        if graph_batch is not None:
            kwargs.update(
                use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(
                    graph_batch + 1, dtype=torch.int32, device=device
                ),
                paged_kv_indices_buffer=torch.zeros(
                    max_pages, dtype=torch.int32, device=device
                ),
                paged_kv_last_page_len_buffer=torch.ones(
                    graph_batch, dtype=torch.int32, device=device
                ),
            )
        return fi.BatchDecodeWithPagedKVCacheWrapper(workspace, LAYOUT[0], **kwargs)
    if graph_batch is not None:
        kwargs.update(
            use_cuda_graph=True,
            qo_indptr_buf=torch.arange(
                graph_batch + 1, dtype=torch.int32, device=device
            ),
            paged_kv_indptr_buf=torch.zeros(
                graph_batch + 1, dtype=torch.int32, device=device
            ),
            paged_kv_indices_buf=torch.zeros(
                max_pages, dtype=torch.int32, device=device
            ),
            paged_kv_last_page_len_buf=torch.ones(
                graph_batch, dtype=torch.int32, device=device
            ),
        )
    return fi.BatchPrefillWithPagedKVCacheWrapper(workspace, LAYOUT[0], **kwargs)


def plan(wrapper, variant: Variant, point: Point, page_size: int) -> None:
    """Plan from host index tensors, the way tpserve's backend does."""
    kwargs = {"q_data_type": DTYPE, "kv_data_type": DTYPE, **dict(variant.plan_kwargs)}
    if variant.wrapper == "decode":
        wrapper.plan(
            point.kv_indptr,
            point.kv_indices,
            point.last_page_len,
            point.q_heads,
            point.kv_heads,
            HEAD_DIM,
            page_size,
            **kwargs,
        )
    else:
        wrapper.plan(
            point.qo_indptr,
            point.kv_indptr,
            point.kv_indices,
            point.last_page_len,
            point.q_heads,
            point.kv_heads,
            HEAD_DIM,
            page_size,
            causal=False,
            **kwargs,
        )


def measure(
    fn: Callable[[], object], warmup: int, iters: int, flush: torch.Tensor | None
) -> float:
    """Median seconds of ``fn`` on the current stream, from CUDA events."""
    if flush is None:
        return time_cuda(fn, warmup=warmup, iters=iters)
    for _ in range(warmup):
        fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in events:
        flush.zero_()  # evicts L2 and keeps the GPU busy while the host enqueues fn
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # first run outside the capture (lazily built buffers, module loads)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def check(row: dict, mode: str, out: torch.Tensor, point: Point) -> None:
    if point.reference is not None:
        row[f"{mode}_max_diff"] = (
            (out.float() - point.reference.float()).abs().max().item()
        )
    if point.torch_reference is not None:
        n = point.torch_reference.shape[0]
        row[f"{mode}_torch_diff"] = (
            (out[:n].float() - point.torch_reference).abs().max().item()
        )


class Bench:
    def __init__(
        self, fi, args: argparse.Namespace, pools: dict, max_pages_per_seq: int
    ) -> None:
        self.fi = fi
        self.args = args
        self.pools = pools
        self.max_pages_per_seq = max_pages_per_seq
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.flush = (
            torch.empty(args.flush_mib * 2**20, dtype=torch.uint8, device="cuda")
            if args.flush_mib > 0
            else None
        )

    def time(self, fn: Callable[[], object]) -> float:
        return measure(fn, self.args.warmup, self.args.iters, self.flush)

    def run_variant(
        self, variant: Variant, points: list[Point], rows: list[dict]
    ) -> dict:
        """Measure ``variant`` at every point, appending one row per point to ``rows``."""
        args = self.args
        info: dict = {
            "variant": variant.name,
            "status": "ok",
            "first_call_s": None,
            "error": None,
            "graph_error": None,
        }
        eager = None
        graph_wrappers: dict[int, object] = {}
        graphs = not args.no_graphs
        for point in points:
            k, v = self.pools[point.kv_heads]
            row: dict = {
                "variant": variant.name,
                "q_heads": point.q_heads,
                "kv_heads": point.kv_heads,
                "batch": point.batch,
                "context": point.context,
                "kv_bytes": point.kv_bytes,
            }
            # ---- eager ----
            first = info["first_call_s"] is None
            try:
                start = time.perf_counter()
                if eager is None:
                    eager = make_wrapper(self.fi, variant, self.workspace, None, 0)
                plan(eager, variant, point, args.page_size)
                out = torch.empty_like(point.q)
                run = partial(eager.run, point.q, (k, v), out=out)
                run()
                torch.cuda.synchronize()
                if first:
                    info["first_call_s"] = time.perf_counter() - start
                    print(
                        f"{variant.name}: first call (wrapper + plan + run, incl. any JIT build/load) "
                        f"{info['first_call_s']:.2f} s",
                        flush=True,
                    )
                check(row, "eager", out, point)
                if variant.name == REFERENCE:
                    point.reference = out.clone()
                plans = []
                for _ in range(args.plan_iters):
                    plan_start = time.perf_counter()
                    plan(eager, variant, point, args.page_size)
                    plans.append(time.perf_counter() - plan_start)
                row["plan_us"] = statistics.median(plans) * 1e6
                row["eager_us"] = self.time(run) * 1e6
            except Exception as exc:  # a failing variant is reported, not fatal
                row["error"] = short_error(exc, 2000)
                print(
                    f"{variant.name} {point.label}: eager FAILED: {short_error(exc)}",
                    flush=True,
                )
                if args.verbose:
                    traceback.print_exc()
                rows.append(row)
                if not cuda_ok():
                    info.update(status="cuda context broken", error=row["error"])
                    raise CudaBroken(row["error"]) from exc
                if first:  # never ran: unsupported (or its kernels failed to build)
                    failed_after = time.perf_counter() - start
                    info.update(
                        status="unsupported",
                        error=row["error"],
                        failed_after_s=failed_after,
                    )
                    print(
                        f"{variant.name}: unsupported (failed after {failed_after:.2f} s), skipped",
                        flush=True,
                    )
                    return info
                continue
            # ---- CUDA graph ----
            if graphs:
                try:
                    wrapper = graph_wrappers.get(point.batch)
                    if wrapper is None:
                        capacity = point.batch * self.max_pages_per_seq
                        wrapper = make_wrapper(
                            self.fi, variant, self.workspace, point.batch, capacity
                        )
                        graph_wrappers[point.batch] = wrapper
                    plan(wrapper, variant, point, args.page_size)
                    graph_out = torch.empty_like(point.q)
                    graph = capture(
                        partial(wrapper.run, point.q, (k, v), out=graph_out)
                    )
                    graph_out.zero_()
                    graph.replay()
                    torch.cuda.synchronize()
                    check(row, "graph", graph_out, point)
                    row["graph_us"] = self.time(graph.replay) * 1e6
                    del graph
                except Exception as exc:
                    row["graph_error"] = short_error(exc, 2000)
                    print(
                        f"{variant.name} {point.label}: graph FAILED: {short_error(exc)}",
                        flush=True,
                    )
                    if args.verbose:
                        traceback.print_exc()
                    if not cuda_ok():
                        rows.append(row)
                        info.update(
                            status="cuda context broken", error=row["graph_error"]
                        )
                        raise CudaBroken(row["graph_error"]) from exc
                    info.update(
                        status="ok (eager only)", graph_error=row["graph_error"]
                    )
                    graphs = False  # keep the eager numbers of the remaining points
            finish_row(row, args.tol)
            rows.append(row)
            print(progress_line(row), flush=True)
        return info


def finish_row(row: dict, tol: float) -> None:
    for mode in ("eager", "graph"):
        if row.get(f"{mode}_us"):
            row[f"{mode}_tbps"] = row["kv_bytes"] / (row[f"{mode}_us"] * 1e-6) / 1e12
    diffs = [row[k] for k in row if k.endswith("_diff")]
    # ``not d <= tol`` also flags NaN.
    row["check"] = (
        "-" if not diffs else ("MISMATCH" if any(not d <= tol for d in diffs) else "ok")
    )


def progress_line(row: dict) -> str:
    parts = [
        f"{row['variant']} heads {row['q_heads']}:{row['kv_heads']} batch {row['batch']} ctx {row['context']}:"
    ]
    parts.append(f"plan {row.get('plan_us', float('nan')):.0f} us")
    for mode in ("eager", "graph"):
        if f"{mode}_us" in row:
            parts.append(
                f"{mode} {row[f'{mode}_us']:.1f} us ({row[f'{mode}_tbps']:.2f} TB/s)"
            )
    diffs = ", ".join(f"{k} {row[k]:.1e}" for k in row if k.endswith("_diff"))
    parts.append(f"[{diffs}] {row['check']}")
    return " ".join(parts)


def point_key(row: dict) -> tuple[int, int, int, int]:
    return row["q_heads"], row["kv_heads"], row["batch"], row["context"]


def rank_rows(rows: list[dict]) -> None:
    """Ratio of each variant's time to the point's best, per mode; ``us`` is the graph time
    where the variant has one, else the eager time."""
    for row in rows:
        us = row.get("graph_us") or row.get("eager_us")
        if us:
            row["us"] = us
            row["tbps"] = row["kv_bytes"] / (us * 1e-6) / 1e12
    for key, ratio in (
        ("eager_us", "eager_vs_best"),
        ("graph_us", "graph_vs_best"),
        ("us", "vs_best"),
    ):
        best: dict[tuple, float] = {}
        for row in rows:
            if row.get(key) and row.get("check") != "MISMATCH":  # wrong is never best
                best[point_key(row)] = min(best.get(point_key(row), math.inf), row[key])
        for row in rows:
            if row.get(key) and point_key(row) in best:
                row[ratio] = row[key] / best[point_key(row)]


def json_safe(value: object) -> object:
    """NaN/inf floats (a broken kernel's diffs) as None: strict JSON has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def fmt_diff(value: float | None) -> str:
    return "" if value is None else f"{value:.1e}"


def summary_rows(
    rows: list[dict], variants: list[Variant], infos: list[dict], copy_bps: float
) -> list[dict]:
    status = {i["variant"]: i["status"] for i in infos}
    by_point: dict[tuple, list[dict]] = {}
    for row in rows:
        by_point.setdefault(point_key(row), []).append(row)
    summary = []
    for key in sorted(by_point):
        group = {r["variant"]: r for r in by_point[key]}
        timed = [
            r for r in group.values() if r.get("us") and r.get("check") != "MISMATCH"
        ]
        q_heads, kv_heads, batch, context = key
        entry: dict = {
            "heads": f"{q_heads}:{kv_heads}",
            "batch": batch,
            "ctx": context,
            "kv_MiB": by_point[key][0]["kv_bytes"] / 2**20,
        }
        if timed:
            best = min(timed, key=lambda r: r["us"])
            entry.update(
                best=best["variant"],
                mode="graph" if best.get("graph_us") else "eager",
                us=best["us"],
                TBps=best["tbps"],
                of_copy=best["tbps"] * 1e12 / copy_bps,
            )
        for variant in variants:
            r = group.get(variant.name)
            if status.get(variant.name) == "unsupported":
                entry[variant.short] = "unsup"
            elif r is None:
                entry[variant.short] = "-"
            elif r.get("check") == "MISMATCH":
                entry[variant.short] = "WRONG"
            elif r.get("vs_best"):
                entry[variant.short] = f"{r['vs_best']:.2f}"
            else:
                entry[variant.short] = "err"
        summary.append(entry)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--heads",
        default="16:8,32:8,40:8",
        help="q_heads:kv_heads list (Qwen3 0.6B, 8B, 14B)",
    )
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--contexts", default="512,1024,4096")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layout", choices=["NHD", "HND"], default="NHD", help="KV cache layout of each page")
    parser.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help=f"comma list; known: {', '.join(NAMED)}, decode_tensor_cores_split<N>",
    )
    parser.add_argument(
        "--iters", type=int, default=30, help="timed runs per point and mode (median)"
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--plan-iters",
        type=int,
        default=3,
        help="plan() calls timed per point (median)",
    )
    parser.add_argument(
        "--flush-mib",
        type=int,
        default=512,
        help="buffer zeroed before each timed run; 0: none",
    )
    parser.add_argument("--no-graphs", action="store_true", help="eager runs only")
    parser.add_argument(
        "--tol", type=float, default=2e-2, help="max abs diff flagged as a mismatch"
    )
    parser.add_argument(
        "--copy-gib",
        type=float,
        default=4.0,
        help="size of the copy-bandwidth measurement",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print tracebacks of failures"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    LAYOUT[0] = args.layout
    try:
        heads = head_configs(args.heads)
        variants = [variant_named(name) for name in args.variants.split(",") if name]
    except ValueError as exc:
        parser.error(str(exc))
    if REFERENCE in {v.name for v in variants}:  # the reference runs first
        variants.sort(key=lambda v: v.name != REFERENCE)
    batches, contexts = ints(args.batch_sizes), ints(args.contexts)

    import flashinfer  # only here: --help works without it

    version = getattr(flashinfer, "__version__", "unknown")
    props = torch.cuda.get_device_properties(0)
    l2_mib = getattr(props, "L2_cache_size", 0) / 2**20
    print(
        f"{device_name()}, L2 {l2_mib:.0f} MiB, torch {torch.__version__}, flashinfer {version}",
        flush=True,
    )
    if version != "0.7.0":
        print(
            f"note: written against flashinfer 0.7.0's API, found {version}", flush=True
        )
    bandwidth = copy_bandwidth(args.copy_gib)
    torch.cuda.empty_cache()
    print(
        f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s (bytes read + written)",
        flush=True,
    )

    max_pages_per_seq = -(-max(contexts) // args.page_size)
    pool_pages = max(batches) * max_pages_per_seq
    payload: dict = {
        "benchmark": "attention_decode",
        "flashinfer": version,
        "torch": torch.__version__,
        "head_dim": HEAD_DIM,
        "dtype": "bfloat16",
        "page_size": args.page_size,
        "layout": args.layout,
        "pool_pages": pool_pages,
        "heads": args.heads,
        "batch_sizes": batches,
        "contexts": contexts,
        "iters": args.iters,
        "warmup": args.warmup,
        "flush_mib": args.flush_mib,
        "tol": args.tol,
        "copy_bandwidth_Bps": bandwidth,
        "complete": False,
    }
    rows: list[dict] = []
    infos: list[dict] = []
    with torch.inference_mode():
        gen = torch.Generator(device="cuda").manual_seed(0)
        pools = {}
        for kv_heads in sorted({kv for _, kv in heads}):
            shape = (pool_pages, args.page_size, kv_heads, HEAD_DIM)
            if LAYOUT[0] == "HND":
                shape = (pool_pages, kv_heads, args.page_size, HEAD_DIM)
            pools[kv_heads] = tuple(
                torch.empty(shape, dtype=DTYPE, device="cuda").normal_(generator=gen)
                for _ in range(2)
            )
        points = make_points(
            heads, batches, contexts, args.page_size, pool_pages, torch.device("cuda")
        )
        for point in points:
            point.torch_reference = torch_attention(point, *pools[point.kv_heads])
        bench = Bench(flashinfer, args, pools, max_pages_per_seq)
        print(
            f"{len(points)} points x {len(variants)} variants; pool {pool_pages} pages of {args.page_size} "
            f"tokens per kv-head count {sorted(pools)}",
            flush=True,
        )
        for variant in variants:
            start = time.perf_counter()
            try:
                info = bench.run_variant(variant, points, rows)
            except CudaBroken as exc:
                infos.append(
                    {
                        "variant": variant.name,
                        "status": "cuda context broken",
                        "error": str(exc),
                    }
                )
                print(
                    f"CUDA context broken during {variant.name}; stopping here",
                    flush=True,
                )
                break
            info["total_s"] = time.perf_counter() - start
            infos.append(info)
            print(
                f"{variant.name}: {info['status']}, {info['total_s']:.1f} s in all",
                flush=True,
            )
            # Partial results after every variant, in case a later one crashes the process.
            write_json(
                args.out, json_safe({**payload, "variants": infos, "rows": rows})
            )
        else:
            payload["complete"] = True

    rank_rows(rows)
    rows.sort(
        key=lambda r: (point_key(r), [v.name for v in variants].index(r["variant"]))
    )
    print(
        "\nPer variant and point (us: CUDA-event median; *_vs_best: time / best variant at the point)"
    )
    table = [
        {
            "variant": r["variant"],
            "heads": f"{r['q_heads']}:{r['kv_heads']}",
            "batch": r["batch"],
            "ctx": r["context"],
            "kv_MiB": r["kv_bytes"] / 2**20,
            "plan_us": r.get("plan_us", ""),
            "eager_us": r.get("eager_us", ""),
            "eager_TBps": r.get("eager_tbps", ""),
            "e_vs_best": r.get("eager_vs_best", ""),
            "graph_us": r.get("graph_us", ""),
            "graph_TBps": r.get("graph_tbps", ""),
            "g_vs_best": r.get("graph_vs_best", ""),
            "max_diff": fmt_diff(r.get("graph_max_diff", r.get("eager_max_diff"))),
            "torch_diff": fmt_diff(
                r.get("graph_torch_diff", r.get("eager_torch_diff"))
            ),
            "check": r.get("check", "error"),
        }
        for r in rows
    ]
    print_table(table, list(table[0]) if table else ["variant"])

    print("\nVariants (first call includes loading or JIT-building the kernels)")
    print_table(
        [
            {
                "variant": i["variant"],
                "status": i["status"],
                "first_call_s": i.get("first_call_s")
                if i.get("first_call_s") is not None
                else "",
                "total_s": i.get("total_s", ""),
                "error": (i.get("error") or i.get("graph_error") or "")[:160],
            }
            for i in infos
        ],
        ["variant", "status", "first_call_s", "total_s", "error"],
    )
    mismatches = [r for r in rows if r.get("check") == "MISMATCH"]
    print(
        f"\nnumerics: {len(mismatches)} mismatching rows (max abs diff > {args.tol} or NaN)"
    )
    for r in mismatches:
        print("  " + progress_line(r))

    summary = summary_rows(rows, variants, infos, bandwidth)
    print(
        f"\ndevice copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written); decode attention reads KV only"
    )
    print(
        "Best variant per point (us: graph replay where captured, else eager; of_copy: its KV TB/s over "
        "the copy bandwidth; variant columns: time / best; WRONG = numerical mismatch, never best)"
    )
    columns = [
        "heads",
        "batch",
        "ctx",
        "kv_MiB",
        "best",
        "mode",
        "us",
        "TBps",
        "of_copy",
    ]
    print_table(summary, columns + [v.short for v in variants])
    final = {**payload, "variants": infos, "rows": rows, "summary": summary}
    write_json(args.out, json_safe(final))


if __name__ == "__main__":
    main()
