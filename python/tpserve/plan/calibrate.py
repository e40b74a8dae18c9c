"""``--calibrate``: measure this machine's figures in place of the table's: device copy bandwidth
(bytes read + written), dense matmul rate in the serving dtype, and the all-reduce latency and
bus bandwidth at TP 2 through the engine's own communicator (its peer-memory kernels and NCCL on
two GPUs, timed inside a CUDA graph as decode runs them; Gloo between two CPU processes)."""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from tpserve.distributed.comm import CudaCommunicator, init_process_groups, local_init_addr
from tpserve.distributed.spawn import on_spawned_ranks
from tpserve.plan.cost import GPUS, GPUSpec, Link

WORKER_TIMEOUT_S = 300
BURST = 10


@dataclass(frozen=True)
class Sizes:
    copy_bytes: int
    matmul_n: int
    small_bytes: int  # an all-reduce this small costs its latency (a decode step's is batch x hidden x 2)
    large_bytes: int  # one this large, its bandwidth
    iters: int


GPU_SIZES = Sizes(copy_bytes=4 << 30, matmul_n=8192, small_bytes=16 << 10, large_bytes=256 << 20, iters=50)
CPU_SIZES = Sizes(copy_bytes=64 << 20, matmul_n=512, small_bytes=16 << 10, large_bytes=4 << 20, iters=10)


@dataclass(frozen=True)
class Calibration:
    device: str  # cuda | cpu
    device_name: str
    memory_bytes: float
    copy_bandwidth: float
    matmul_flops: float
    link: Link | None  # None: fewer than two GPUs, nothing to measure between
    hopper: bool = False  # compute capability 9.x: FP8 KV caches decode through XQA

    def as_spec(self) -> GPUSpec:
        base = GPUS["cpu"] if self.device == "cpu" else GPUS["h200"]
        return replace(
            base,
            name=self.device_name,
            memory_bytes=self.memory_bytes,
            copy_bandwidth=self.copy_bandwidth,
            matmul_flops=self.matmul_flops,
            link=self.link or base.link,
            fp8_attention=self.hopper,
        )


def _cuda_seconds(fn: Callable[[], object]) -> float:
    """Seconds of one call of ``fn`` on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _wall_seconds(fn: Callable[[], object]) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def time_device(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` after a warm-up: CUDA events on the current stream, the wall
    clock on the CPU."""
    for _ in range(warmup):
        fn()
    timer = _cuda_seconds if device.type == "cuda" else _wall_seconds
    return statistics.median(timer(fn) for _ in range(iters))


def _dtype(device: torch.device) -> torch.dtype:
    """The engine's default dtype on ``device``."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def copy_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    dtype = _dtype(device)
    src = torch.randn(nbytes // dtype.itemsize, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * dtype.itemsize / time_device(lambda: dst.copy_(src), device, iters)


def matmul_flops(device: torch.device, n: int, iters: int) -> float:
    dtype = _dtype(device)
    pairs = itertools.cycle([(torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device))
                             for _ in range(3)])
    out = torch.empty(n, n, dtype=dtype, device=device)

    def run() -> None:
        torch.matmul(*next(pairs), out=out)

    return 2 * n**3 / time_device(run, device, iters)


def time_in_graph(fn: Callable[[], object], iters: int, repeat: int = BURST,
                  before_replay: Callable[[], object] | None = None) -> float:
    """Median seconds per call of ``fn`` captured ``repeat`` times back to back in one CUDA graph
    (``before_replay``, e.g. a barrier that lines the ranks up, runs untimed before each replay).
    Decode replays its collectives from a graph: timed eagerly, the host's launch cost of a
    peer-memory all-reduce (tens of microseconds) would be counted instead of the GPU's."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    times = []
    for _ in range(iters):
        if before_replay is not None:
            before_replay()
        torch.cuda.synchronize()
        times.append(_cuda_seconds(graph.replay) / repeat)
    return statistics.median(times)


def _all_reduce_rank(rank: int, addr: str, device_type: str, sizes: Sizes) -> list[float]:
    device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = _dtype(device)
    comm, _ = init_process_groups(rank, 2, addr, device, dtype)
    try:
        seconds = []
        for nbytes in (sizes.small_bytes, sizes.large_bytes):
            x = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)  # values never matter here
            if device.type == "cuda":
                seconds.append(time_in_graph(lambda: comm.all_reduce(x), sizes.iters, before_replay=torch.distributed.barrier))
                continue

            def burst() -> None:  # back to back, as a step's layers issue them
                for _ in range(BURST):
                    comm.all_reduce(x)

            seconds.append(time_device(burst, device, sizes.iters) / BURST)
        return seconds
    finally:
        if isinstance(comm, CudaCommunicator):
            comm.close()
        torch.distributed.destroy_process_group()


def all_reduce_link(device_type: str, sizes: Sizes) -> Link:
    """Alpha and bus bandwidth of a 2-rank all-reduce: the small message's time is the latency,
    the large one's rest is its bytes over the bus (2(n-1)/n = 1 for n = 2)."""
    try:
        results = on_spawned_ranks(_all_reduce_rank, 2, local_init_addr(), device_type, sizes, timeout_s=WORKER_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as e:
        raise RuntimeError(f"the all-reduce measurement did not finish: {e}") from e
    alpha, large = (max(seconds[i] for seconds in results) for i in range(2))
    transfer = max(large - alpha, large * 0.05)  # a noisy small time cannot make the bandwidth infinite
    return Link(alpha_s=alpha, bus_bandwidth=(sizes.large_bytes - sizes.small_bytes) / transfer)


def _memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(device_type: str | None = None, sizes: Sizes | None = None) -> Calibration:
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda:0" if device_type == "cuda" else "cpu")
    sizes = sizes or (GPU_SIZES if device_type == "cuda" else CPU_SIZES)
    name = torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu"
    link = None
    if device_type == "cpu" or torch.cuda.device_count() >= 2:
        link = all_reduce_link(device_type, sizes)
    return Calibration(
        device=device_type,
        device_name=name,
        memory_bytes=_memory_bytes(device),
        copy_bandwidth=copy_bandwidth(device, sizes.copy_bytes, sizes.iters),
        matmul_flops=matmul_flops(device, sizes.matmul_n, sizes.iters),
        link=link,
        hopper=device_type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9,
    )
