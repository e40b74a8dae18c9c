"""The cost model: one step's time on one TP group, split into compute/memory and all-reduce.

Communication is seed 003's ring model: each all-reduce of ``size`` bytes over n ranks costs
alpha + 2(n-1)/n * size / bus_bandwidth, two per decoder layer of tokens x hidden x dtype bytes,
plus the embedding's all-reduce and the LM head's all-gather. Decode is bound by the bytes a step
reads (weights once, every sequence's KV), prefill by its FLOPs.

The efficiency constants are fit to tpserve's own H200 runs (docs/benchmarks.md): cuBLAS reads
decode weights at ~85% of the copy bandwidth; FlashInfer's decode attention reads a short cache
at ~54% of it and a 4,096-token one at ~90%; a Qwen3-8B step spends ~20 us per layer in small
kernels; prefill runs at ~75% of the matmul rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.plan.shape import ModelShape
from tpserve.plan.specs import GPUSpec, Link

GEMM_BANDWIDTH_FRACTION = 0.85
GEMM_FLOPS_FRACTION = 0.9  # large decode batches, where the linears become compute-bound
PREFILL_MFU = 0.75
CHUNKED_PREFILL_SIZE = 8192  # the engine's default --chunked-prefill-size


def attention_bandwidth_fraction(context: int) -> float:
    """Decode attention streams too few pages per block to hide latency at short contexts."""
    return 0.95 * context / (context + 384)


def all_reduce_seconds(size_bytes: float, n: int, link: Link) -> float:
    if n == 1:
        return 0.0
    return link.alpha_s + 2 * (n - 1) / n * size_bytes / link.bus_bandwidth


def all_gather_seconds(out_bytes: float, n: int, link: Link) -> float:
    """Every rank ends with ``out_bytes``, (n-1)/n of which came over the link."""
    if n == 1:
        return 0.0
    return link.alpha_s + (n - 1) / n * out_bytes / link.bus_bandwidth


def layers_all_reduce_seconds(shape: ModelShape, tokens: int, tp: int, link: Link) -> float:
    """The decoder layers' two all-reduces each of ``tokens`` x hidden activations (seed 003's figure)."""
    return 2 * shape.layers * all_reduce_seconds(tokens * shape.hidden * shape.dtype_bytes, tp, link)


def comm_seconds(shape: ModelShape, tokens: int, last_tokens: int, tp: int, link: Link) -> float:
    """Every collective of one forward: the layers', the embedding's all-reduce and the
    all-gather of the sampled rows' logits."""
    if tp == 1:
        return 0.0
    embed = all_reduce_seconds(tokens * shape.hidden * shape.dtype_bytes, tp, link)
    logits = all_gather_seconds(last_tokens * shape.vocab_rows(tp) * tp * shape.dtype_bytes, tp, link)
    return layers_all_reduce_seconds(shape, tokens, tp, link) + embed + logits


@dataclass(frozen=True)
class StepCost:
    seconds: float
    comm_seconds: float

    @property
    def comm_share(self) -> float:
        return self.comm_seconds / self.seconds if self.seconds else 0.0


def decode_step(shape: ModelShape, gpu: GPUSpec, tp: int, batch: int, context: int, link: Link | None = None) -> StepCost:
    """One decode step of ``batch`` sequences that each hold ``context`` cached tokens."""
    link = link or gpu.link
    weights = max(
        shape.decode_read_bytes(tp, batch) / (gpu.copy_bandwidth * GEMM_BANDWIDTH_FRACTION),
        shape.linear_flops(tp, batch, batch) / (gpu.matmul_flops * GEMM_FLOPS_FRACTION),
    )
    # An FP8 cache costs its bytes where XQA reads it; the decode wrapper elsewhere is as slow as bf16.
    read_as = None if gpu.fp8_attention or shape.kv_dtype_bytes is None else shape.dtype_bytes
    kv = batch * (context + 1) * shape.kv_bytes_per_token(tp, read_as) / (gpu.copy_bandwidth * attention_bandwidth_fraction(context))
    comm = comm_seconds(shape, batch, batch, tp, link)
    return StepCost(weights + kv + shape.layers * gpu.layer_overhead_s + comm, comm)


def prefill_seconds(shape: ModelShape, gpu: GPUSpec, tp: int, tokens: int, link: Link | None = None) -> StepCost:
    """Prefill of one ``tokens``-long prompt, in chunks of the engine's default size."""
    link = link or gpu.link
    chunks = -(-tokens // CHUNKED_PREFILL_SIZE)
    flops = shape.linear_flops(tp, tokens, chunks) + shape.attention_flops(tp, tokens * (tokens + 1) / 2)
    reads = chunks * shape.decode_read_bytes(tp, min(tokens, CHUNKED_PREFILL_SIZE))
    compute = max(flops / (gpu.matmul_flops * PREFILL_MFU), reads / gpu.copy_bandwidth)
    comm = 0.0
    for start in range(0, tokens, CHUNKED_PREFILL_SIZE):
        comm += comm_seconds(shape, min(CHUNKED_PREFILL_SIZE, tokens - start), 1, tp, link)
    return StepCost(compute + chunks * shape.layers * gpu.layer_overhead_s + comm, comm)
