"""The machines the planner knows: one GPU's memory, the rates a step can reach on it, and the
all-reduce link between the GPUs of a node (and between nodes).

Rates are *achievable* figures, the quantities ``--calibrate`` measures (device copy bandwidth
counting bytes read + written, dense bf16 matmul rate, NCCL all-reduce latency and bus
bandwidth), not datasheet peaks. H200 figures are the ones measured in docs/benchmarks.md; H100
and A100 are their datasheets scaled by the same achieved fractions (copy 0.885, matmul 0.77 on
Hopper). CPU figures are rough: use ``--calibrate`` there.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


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
    layer_overhead_s: float  # per decoder layer and step: small kernels, launch tails (fit to H200 runs)
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
