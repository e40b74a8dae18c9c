"""Run by test_tp2.py on two GPUs: the fused all-reduce + residual add + RMSNorm (one-shot,
two-shot, and ``--all-reduce fused``'s routing through the communicator) against the float64
reference and against the unfused path (all-reduce, then FlashInfer's add+RMSNorm), eager and
replayed from CUDA graphs, at decode and prefill token counts. Both ranks must get bit-identical
results. Prints "fused ok" on success."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tp2_allreduce_check import check_same_on_ranks  # this directory: the scripts run as files

from tpserve.distributed.comm import CudaCommunicator, init_process_groups, local_init_addr
from tpserve.distributed.fused_allreduce import MAX_BYTES, FusedAllReduceNorm
from tpserve.kernels.flashinfer_ops import fused_add_rms_norm_
from tpserve.layers.norm import RMSNorm

EPS = 1e-6
# (tokens, hidden): Qwen3-32B's hidden at batch 1-800 (800 x 5120 x 2 B is just under MAX_BYTES),
# the TP 2 test model's 512, and 3 tokens (two-shot's uneven split between the ranks).
SHAPES = [(1, 5120), (2, 5120), (3, 5120), (8, 5120), (64, 5120), (256, 5120), (800, 5120), (1, 512), (37, 512), (130, 1024)]


def reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    new_residual = sum(p.double() for p in parts) + residual.double()
    normed = new_residual * torch.rsqrt(new_residual.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    return normed, new_residual


def close(name: str, got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    if err > scale * rel:
        raise AssertionError(f"{name}: max error {err} against max |value| {scale}")


def run(fn, x: torch.Tensor, residual: torch.Tensor, graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(x, residual)`` in place on copies, eagerly or captured and replayed."""
    sx, sr = x.clone(), residual.clone()
    if not graph:
        out = fn(sx, sr)
    else:
        fn(sx, sr)  # warm up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn(sx, sr)
        sx.copy_(x)
        sr.copy_(residual)
        g.replay()
    torch.cuda.synchronize()
    return out[0].clone(), out[1].clone()


def check_shape(rank: int, comm: CudaCommunicator, forced: dict, tokens: int, hidden: int, seed: int) -> None:
    device = torch.device("cuda", rank)
    gen = torch.Generator(device=device).manual_seed(seed * 2 + rank)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, generator=gen)
    shared = torch.Generator(device=device).manual_seed(seed)  # the residual and weight every rank holds
    residual = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, generator=shared)
    norm = RMSNorm(hidden, EPS).to(device=device, dtype=torch.bfloat16)
    norm.weight.data.copy_(torch.rand(hidden, device=device, generator=shared) + 0.5)
    w = norm.weight.data
    want_normed, want_residual = reference(x, residual, w)
    unfused = run(lambda a, r: fused_add_rms_norm_(comm.all_reduce(a), r, w, EPS), x, residual, graph=False)
    paths = {
        "routed": lambda a, r: comm.all_reduce_add_rmsnorm(a, r, norm),
        "one_shot": lambda a, r: forced["one_shot"](a, r, w, EPS),
        "two_shot": lambda a, r: forced["two_shot"](a, r, w, EPS),
    }
    if not comm.fused.handles(x, residual):
        raise AssertionError(f"the fused kernel refuses {tokens} x {hidden}")
    for name, fn in paths.items():
        if name == "two_shot" and tokens <= 2:
            continue  # falls back to one-shot: two-shot splits the tokens between the ranks
        for graph in (False, True):
            what = f"{name} {tokens}x{hidden} graph={graph}"
            normed, new_residual = run(fn, x, residual, graph)
            # a few bf16 roundings (the sum, the residual add, the output) of values up to ~8:
            # a wrong sum or norm is off by O(1)
            close(f"{what} residual", new_residual, want_residual, 2**-6)
            close(f"{what} normed", normed, want_normed, 2**-6)
            close(f"{what} normed vs unfused", normed, unfused[0], 2**-6)
            close(f"{what} residual vs unfused", new_residual, unfused[1], 2**-6)
            check_same_on_ranks(normed, f"{what} normed")
            check_same_on_ranks(new_residual, f"{what} residual")


def rank_main(rank: int, addr: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    comm, _cpu = init_process_groups(rank, 2, addr, device, torch.bfloat16, "fused")
    if not isinstance(comm, CudaCommunicator) or comm.fused is None:
        raise AssertionError("the fused all-reduce + RMSNorm did not start (see the warning above)")
    group = dist.group.WORLD
    forced = {
        "one_shot": FusedAllReduceNorm(group, device, torch.bfloat16, MAX_BYTES, one_shot_max_bytes=MAX_BYTES),
        "two_shot": FusedAllReduceNorm(group, device, torch.bfloat16, MAX_BYTES, one_shot_max_bytes=0),
    }
    for seed, (tokens, hidden) in enumerate(SHAPES):
        check_shape(rank, comm, forced, tokens, hidden, seed)
    # larger than the fused kernel's buffers: the communicator runs the all-reduce and norm apart
    big = torch.zeros(MAX_BYTES // (2 * 5120) + 1, 5120, dtype=torch.bfloat16, device=device)
    if comm.fused.handles(big, big):
        raise AssertionError("the fused kernel claims a message larger than its buffers")
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        print("fused ok")
    for f in forced.values():
        f.close()
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(local_init_addr(),), nprocs=2, join=True)
    sys.exit(0)
