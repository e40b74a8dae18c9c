"""Run by test_tp2.py on two GPUs: the peer-memory all-reduce (one-shot, two-shot and auto's
routing with NCCL for large messages) against the float64 sum, eager and replayed from CUDA
graphs. Both ranks must get bit-identical results (the ranks' models must not drift apart).
Prints "all sizes ok" on success."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpserve.distributed.comm import CudaCommunicator, init_process_groups, local_init_addr
from tpserve.distributed.peer_allreduce import BUFFER_BYTES, PeerAllReduce

NUMELS = [8, 64, 1024, 5120, 5120 * 8, 5120 * 64, 5120 * 256, BUFFER_BYTES // 2, BUFFER_BYTES]  # the last: NCCL


def check(rank: int, name: str, fn, numel: int, graph: bool, seed: int) -> None:
    device = torch.device("cuda", rank)
    gen = torch.Generator(device=device).manual_seed(seed * 2 + rank)
    x = torch.randn(numel, dtype=torch.bfloat16, device=device, generator=gen)
    if graph:
        static = torch.zeros_like(x)
        fn(static.clone())  # warm up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn(static)
        static.copy_(x)
        g.replay()
        y = out.clone()
    else:
        y = fn(x.clone())
    torch.cuda.synchronize()
    parts = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(parts, x)
    want = (parts[0].double() + parts[1].double()).to(torch.bfloat16)
    err = (y.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    if err > scale * 2**-8:
        raise AssertionError(f"{name} numel {numel} graph {graph}: max error {err} (max |sum| {scale})")
    check_same_on_ranks(y, f"{name} numel {numel} graph {graph}")


def check_same_on_ranks(t: torch.Tensor, what: str) -> None:
    mine, others = t.clone(), [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(others, mine)
    if not all(torch.equal(others[0], o) for o in others[1:]):
        raise AssertionError(f"{what}: the ranks' results differ")


def rank_main(rank: int, addr: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    comm, _cpu = init_process_groups(rank, 2, addr, device, torch.bfloat16, "auto")
    assert isinstance(comm, CudaCommunicator) and comm.peer is not None, "peer all-reduce unavailable"
    one = PeerAllReduce(dist.group.WORLD, device, torch.bfloat16, one_shot_max_bytes=BUFFER_BYTES)
    paths = {"auto": comm.all_reduce, "one_shot": one.one_shot, "two_shot": one.two_shot}
    seed = 0
    for numel in NUMELS:
        for name, fn in paths.items():
            if name != "auto" and numel * 2 > BUFFER_BYTES:
                continue
            for graph in (False, True):
                seed += 1
                check(rank, name, fn, numel, graph, seed)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        print("all sizes ok")
    one.close()
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(local_init_addr(),), nprocs=2, join=True)
    sys.exit(0)
