"""TP all-reduce latency by message size: NCCL against the peer-memory one-shot and two-shot
kernels (tpserve.distributed.peer_allreduce) and tpserve's routing (auto), on N local GPUs.

Each point captures 20 back-to-back all-reduces of one bf16 tensor in a CUDA graph (as decode
runs them) and times graph replays with CUDA events; the figure is the median per all-reduce.
Every path's result is checked against NCCL's first.

    python benchmarks/allreduce_latency.py --tp-size 2 --out out/allreduce.json
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpserve.distributed.comm import init_process_groups, local_init_addr
from tpserve.distributed.peer_allreduce import BUFFER_BYTES, PeerAllReduce
from tpserve.plan.calibrate import time_in_graph

SIZES_KIB = [2, 10, 32, 80, 160, 320, 640, 1280, 2560, 5120, 8192, 20480, 81920]
REPEAT = 20


def time_graph(fn, x: torch.Tensor, iters: int = 30) -> float:
    """Median seconds per call of ``fn(x)`` over graph replays of REPEAT calls."""
    return time_in_graph(lambda: fn(x), iters, REPEAT, before_replay=dist.barrier)


def rank_main(rank: int, world: int, addr: str, queue) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    comm, _ = init_process_groups(rank, world, addr, device, torch.bfloat16, "auto")
    one = PeerAllReduce(dist.group.WORLD, device, torch.bfloat16, one_shot_max_bytes=BUFFER_BYTES)

    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    paths = {"nccl": nccl, "one_shot": one.one_shot, "two_shot": one.two_shot, "auto": comm.all_reduce}
    rows = []
    for kib in SIZES_KIB:
        numel = kib * 1024 // 2
        base = torch.randn(numel, dtype=torch.bfloat16, device=device, generator=torch.Generator(device).manual_seed(rank))
        want = nccl(base.clone())
        row = {"size_kib": kib}
        for name, fn in paths.items():
            if name in ("one_shot", "two_shot") and numel * 2 > BUFFER_BYTES:
                continue
            got = fn(base.clone())
            if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
                raise AssertionError(f"{name} at {kib} KiB disagrees with NCCL")
            # Keep the values bounded while the graph adds REPEAT times in place.
            x = (base / world**REPEAT).clone() if name in ("nccl", "two_shot", "auto") else base.clone()
            row[f"{name}_us"] = time_graph(fn, x) * 1e6
        rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    one.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from common import device_name, print_table, write_json

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(rank_main, args=(args.tp_size, local_init_addr(), queue), nprocs=args.tp_size,
                       join=True, start_method="spawn")
    rows = queue.get()
    for row in rows:
        fastest = min((v, k[:-3]) for k, v in row.items() if k.endswith("_us") and k != "auto_us")
        row["best"] = fastest[1]
        row["auto_vs_nccl"] = row["nccl_us"] / row["auto_us"]
    print(f"\nAll-reduce latency (us per op, CUDA graph of {REPEAT}), TP {args.tp_size} on {device_name()}, "
          f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    print_table(rows, ["size_kib", "nccl_us", "one_shot_us", "two_shot_us", "auto_us", "auto_vs_nccl", "best"])
    write_json(args.out, {"benchmark": "allreduce_latency", "tp_size": args.tp_size, "rows": rows})


if __name__ == "__main__":
    main()
