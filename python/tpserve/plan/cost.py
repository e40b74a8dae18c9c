"""The cost model: the devices the planner knows, what a model costs per rank at a TP size, and
one step's time on one TP group, split into compute/memory and all-reduce.

Device rates are achievable figures (what ``--calibrate`` measures), not datasheet peaks: H200's
are measured, H100's and A100's their datasheets scaled by the same achieved fractions (copy 0.885,
matmul 0.77 on Hopper), the CPU's rough. The efficiency constants are fit to tpserve's H200 runs
(docs/benchmarks.md)."""

from __future__ import annotations

import math

from dataclasses import dataclass

from tpserve.config import ModelConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GEMM_BANDWIDTH_FRACTION = 0.85  # cuBLAS reads decode weights at ~85% of the copy bandwidth
GEMM_FLOPS_FRACTION = 0.9  # large decode batches, where the linears become compute-bound
PREFILL_MFU = 0.75
CHUNKED_PREFILL_SIZE = 8192  # the engine's default --chunked-prefill-size


@dataclass(frozen=True)
class Link:
    """A ring all-reduce of ``size`` bytes over n ranks takes alpha + 2(n-1)/n * size / bus_bandwidth."""

    alpha_s: float
    bus_bandwidth: float  # bytes/s


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: float
    copy_bandwidth: float  # bytes/s, read + written
    matmul_flops: float  # FLOP/s, dense, in the serving dtype
    link: Link  # within a node
    layer_overhead_s: float  # per decoder layer and step: small kernels, launch tails (~20 us on H200)
    device: str = "cuda"  # what ``python -m tpserve --device`` runs it on
    # Whether decode attention reads an FP8 KV cache at its byte count (XQA on Hopper); elsewhere
    # FlashInfer's decode wrapper converts it element by element, as slow as a bf16 cache.
    fp8_attention: bool = False


# Between nodes: one 400 Gb/s NIC per GPU (about 50 GB/s, ~45 GB/s achieved) and a longer latency.
NETWORK = Link(alpha_s=25e-6, bus_bandwidth=45e9)

GPUS: dict[str, GPUSpec] = {
    "h200": GPUSpec("h200", 140 * GIB, 4.25e12, 760e12, Link(10e-6, 360e9), 20e-6, fp8_attention=True),
    "h100": GPUSpec("h100", 80 * GIB, 2.96e12, 760e12, Link(10e-6, 360e9), 20e-6, fp8_attention=True),
    "a100": GPUSpec("a100", 80 * GIB, 1.80e12, 280e12, Link(12e-6, 230e9), 20e-6),
    "cpu": GPUSpec("cpu", 64 * GIB, 20e9, 0.5e12, Link(100e-6, 5e9), 50e-6, device="cpu"),
}


@dataclass(frozen=True)
class ModelShape:
    """The bytes a model holds and reads per rank, its FLOPs and its KV bytes per token, counted
    the way tpserve's parallel layers split it. With FP8 weights the decoder layers' linears are
    1 byte each plus a float32 scale per block; embeddings, LM head, norms and biases stay in the
    serving dtype, as tpserve keeps them."""

    config: ModelConfig
    dtype_bytes: int
    fp8_block: tuple[int, int] | None = None  # FP8 linear weights with a scale per block of this shape
    kv_dtype_bytes: int | None = None  # bytes per KV-cache element; None: the serving dtype's
    # a MoE model's experts FP8 too (an FP8 checkpoint's, or quantized at load by --quantization fp8)
    fp8_experts: bool = False
    # FP8 scales per output row (compressed-tensors): every FP8 weight holds one a row, not one per fp8_block
    fp8_row_scales: bool = False
    # whole experts per rank (--expert-parallel) instead of a slice of every expert
    expert_parallel: bool = False

    @property
    def linear_bytes(self) -> float:
        """Bytes per decoder-layer linear weight."""
        if self.fp8_block is None:
            return self.dtype_bytes
        if self.fp8_row_scales:  # a float32 per output row, counted as if each had K = hidden inputs (a rank's o and
            return 1 + 4 / self.hidden  # down rows have fewer, all of them kept: a few MB a model more at large TP)
        return 1 + 4 / (self.fp8_block[0] * self.fp8_block[1])

    @property
    def layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden(self) -> int:
        return self.config.hidden_size

    def kv_heads_per_rank(self, tp: int) -> int:
        return self.config.kv_heads_per_rank(tp)

    def expert_params(self, tp: int = 1) -> int:
        """One expert's gate/up/down on a rank: a slice of every expert, or whole experts (expert parallel)."""
        moe = self.config.moe
        return 0 if moe is None else 3 * self.hidden * (moe.intermediate_size // (1 if self.expert_parallel else tp))

    def experts_per_rank(self, tp: int = 1) -> int:
        moe = self.config.moe
        return 0 if moe is None else moe.num_experts // (tp if self.expert_parallel else 1)

    def touched_experts(self, tokens: int, tp: int = 1) -> float:
        """Expected distinct experts a sparse layer reads on a rank for ``tokens`` tokens under uniform routing
        (as benchmarks/roofline.py: trained routers are less even, so this reads conservatively many). Expert
        parallel, the step waits for the rank that got the most: the expected max over the ranks of their touched
        experts, each of a rank's taken as independently touched (a binomial)."""
        moe = self.config.moe
        if moe is None or tokens <= 0:
            return 0.0
        touched = 1 - (1 - moe.top_k / moe.num_experts) ** tokens  # one expert's chance
        if not (self.expert_parallel and tp > 1):
            return moe.num_experts * touched
        held = self.experts_per_rank(tp)
        cdf, below = 0.0, []
        for m in range(held):
            cdf += math.comb(held, m) * touched**m * (1 - touched) ** (held - m)
            below.append(min(cdf, 1.0))
        return sum(1 - f**tp for f in below)  # E[max] = sum over m of P(max > m)

    def expert_bytes(self, tp: int = 1) -> float:
        """Bytes per expert weight on a rank."""
        moe = self.config.moe
        if not self.fp8_experts or moe is None:
            return self.dtype_bytes
        if self.fp8_row_scales:  # a float32 per row: gate/up's 2 I_rank rows and down's H rows (every rank's, whole)
            inter = self.expert_params(tp) // (3 * self.hidden)
            return 1 + 4 * (2 * inter + self.hidden) / (3 * self.hidden * inter)
        return self.linear_bytes

    def sparse_layer_params(self, tp: int = 1, experts: float | None = None) -> tuple[float, float]:
        """(experts, routers) of every sparse layer on a rank: ``experts`` experts per layer (None: all of
        them); the routers, whole on every rank, stay in the serving dtype."""
        moe = self.config.moe
        if moe is None:
            return 0.0, 0.0
        held = self.experts_per_rank(tp) if experts is None else experts
        return len(moe.layers) * held * self.expert_params(tp), len(moe.layers) * moe.num_experts * self.hidden

    def linear_weight_bytes(self, tp: int = 1, experts: float | None = None) -> float:
        """Bytes of the decoder layers' linear weights on a rank (``experts`` as in ``layers_linear_params``)."""
        expert_params, router_params = self.sparse_layer_params(tp, experts)
        rest = self.layers_linear_params(tp, experts) - expert_params - router_params
        return rest * self.linear_bytes + expert_params * self.expert_bytes(tp) + router_params * self.dtype_bytes

    def layers_linear_params(self, tp: int = 1, experts: float | None = None) -> float:
        """The decoder layers' linear weights on a rank: attention, dense MLPs, the routers (whole on
        every rank), ``experts`` experts per sparse layer (None: all of them) and its shared expert (Qwen2-MoE: a
        dense MLP, and its gate whole on every rank)."""
        c, moe = self.config, self.config.moe
        heads = c.num_attention_heads // tp
        qkv_width = (heads + 2 * self.kv_heads_per_rank(tp)) * c.head_dim
        attention = c.hidden_size * qkv_width + heads * c.head_dim * c.hidden_size
        dense_mlp = 3 * self.hidden * (c.intermediate_size // tp)
        sparse_layers, per_sparse = 0, 0.0
        if moe is not None:
            sparse_layers = len(moe.layers)
            held = self.experts_per_rank(tp) if experts is None else experts
            shared = 3 * self.hidden * (moe.shared_intermediate_size // tp) + self.hidden if moe.shared_intermediate_size else 0
            per_sparse = moe.num_experts * self.hidden + held * self.expert_params(tp) + shared
        return self.layers * attention + (self.layers - sparse_layers) * dense_mlp + sparse_layers * per_sparse

    def layer_small_params(self, tp: int = 1) -> int:
        """Norms and biases: every rank keeps its own (norms whole, biases and OLMoE's q/k norms its slice)."""
        c = self.config
        norms = 2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)
        if c.projection_qk_norm:
            norms += (c.num_attention_heads // tp + self.kv_heads_per_rank(tp)) * c.head_dim
        bias = (c.num_attention_heads // tp + 2 * self.kv_heads_per_rank(tp)) * c.head_dim if c.qkv_bias else 0
        return norms + bias

    def vocab_rows(self, tp: int = 1) -> int:
        return -(-self.config.vocab_size // tp)  # the last rank's slice is padded

    def params_per_rank(self, tp: int = 1) -> int:
        c = self.config
        tables = (1 if c.tie_word_embeddings else 2) * self.vocab_rows(tp) * c.hidden_size
        return int(self.layers_linear_params(tp)) + self.layers * self.layer_small_params(tp) + tables + c.hidden_size

    def params(self) -> int:
        """The whole model's parameters (TP 1)."""
        return self.params_per_rank(1)

    def weight_bytes_per_rank(self, tp: int) -> float:
        linear = self.layers_linear_params(tp)
        return self.linear_weight_bytes(tp) + (self.params_per_rank(tp) - linear) * self.dtype_bytes

    def decode_read_bytes(self, tp: int, batch: int) -> float:
        """Weight bytes one step over ``batch`` tokens reads on a rank: every layer's weights once
        (of a sparse layer, the router and the experts the tokens touch) and the LM head; an untied
        input embedding only for the batch's rows."""
        c = self.config
        head = self.vocab_rows(tp) * c.hidden_size
        embed = 0 if c.tie_word_embeddings else min(batch, self.vocab_rows(tp)) * c.hidden_size
        linear = self.linear_weight_bytes(tp, self.touched_experts(batch, tp))
        return linear + (self.layers * self.layer_small_params(tp) + head + embed) * self.dtype_bytes

    def linear_flops(self, tp: int, tokens: int, last_tokens: int) -> float:
        """Matmul FLOPs of the decoder layers over ``tokens`` (top-k experts each) and of the LM
        head over the ``last_tokens`` that sample, on one rank."""
        moe = self.config.moe
        # a token's top k experts: cut over the ranks, or whole on top_k / tp ranks' worth on average (expert parallel)
        active_experts = 0 if moe is None else moe.top_k / (tp if self.expert_parallel else 1)
        active = self.layers_linear_params(tp, active_experts)
        head = self.vocab_rows(tp) * self.hidden
        return 2.0 * (active * tokens + head * last_tokens)

    def attention_flops(self, tp: int, pairs: float) -> float:
        """QK^T and PV over ``pairs`` (query, key) pairs, on one rank."""
        heads = self.config.num_attention_heads // tp
        return 4.0 * self.layers * heads * self.config.head_dim * pairs

    def kv_bytes_per_token(self, tp: int, element_bytes: float | None = None) -> float:
        """One rank's K and V bytes for one token over every layer (``element_bytes``: count each
        element as that many bytes instead of the cache's own)."""
        if element_bytes is None:
            element_bytes = self.dtype_bytes if self.kv_dtype_bytes is None else self.kv_dtype_bytes
        return 2 * self.layers * self.kv_heads_per_rank(tp) * self.config.head_dim * element_bytes


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
    """The decoder layers' two all-reduces each of ``tokens`` x hidden activations (seed 003's figure), and OLMoE's
    third of the q/k norms' float32 sums of squares (``tokens`` x 2)."""
    layer = 2 * all_reduce_seconds(tokens * shape.hidden * shape.dtype_bytes, tp, link)
    if shape.config.projection_qk_norm:
        layer += all_reduce_seconds(tokens * 2 * 4, tp, link)
    return shape.layers * layer


def comm_seconds(shape: ModelShape, tokens: int, last_tokens: int, tp: int, link: Link) -> float:
    """Every collective of one forward: the layers', the embedding's all-reduce and the
    all-gather of the sampled rows' logits."""
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
    """One decode step of ``batch`` sequences that each hold ``context`` cached tokens: bound by the
    bytes it reads (weights once, every sequence's KV), or by the linears' FLOPs at large batches."""
    link = link or gpu.link
    weights = max(
        shape.decode_read_bytes(tp, batch) / (gpu.copy_bandwidth * GEMM_BANDWIDTH_FRACTION),
        shape.linear_flops(tp, batch, batch) / (gpu.matmul_flops * GEMM_FLOPS_FRACTION),
    )
    read_as = None if gpu.fp8_attention or shape.kv_dtype_bytes is None else shape.dtype_bytes
    kv_bytes = batch * (context + 1) * shape.kv_bytes_per_token(tp, read_as)
    # FlashInfer's decode attention reads a short cache at ~54% of the copy bandwidth, a 4,096-token
    # one at ~90%: at short contexts it streams too few pages per block to hide latency.
    kv = kv_bytes / (gpu.copy_bandwidth * (0.95 * context / (context + 384)))
    comm = comm_seconds(shape, batch, batch, tp, link)
    return StepCost(weights + kv + shape.layers * gpu.layer_overhead_s + comm, comm)


def prefill_seconds(shape: ModelShape, gpu: GPUSpec, tp: int, tokens: int, link: Link | None = None) -> StepCost:
    """Prefill of one ``tokens``-long prompt, in chunks of the engine's default size: bound by its FLOPs."""
    link = link or gpu.link
    chunks = -(-tokens // CHUNKED_PREFILL_SIZE)
    flops = shape.linear_flops(tp, tokens, chunks) + shape.attention_flops(tp, tokens * (tokens + 1) / 2)
    reads = chunks * shape.decode_read_bytes(tp, min(tokens, CHUNKED_PREFILL_SIZE))
    compute = max(flops / (gpu.matmul_flops * PREFILL_MFU), reads / gpu.copy_bandwidth)
    chunk_tokens = (min(CHUNKED_PREFILL_SIZE, tokens - start) for start in range(0, tokens, CHUNKED_PREFILL_SIZE))
    comm = sum(comm_seconds(shape, n, 1, tp, link) for n in chunk_tokens)
    return StepCost(compute + chunks * shape.layers * gpu.layer_overhead_s + comm, comm)
