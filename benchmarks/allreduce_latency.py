"""TP all-reduce latency by message size: NCCL against the peer-memory one-shot and two-shot
kernels (tpserve.distributed.peer_allreduce) and tpserve's routing (auto), on N local GPUs; and
the all-reduce + residual add + RMSNorm of a decoder layer, run apart (NCCL, auto or one-shot,
then FlashInfer's add+RMSNorm) against the fused kernel (tpserve.distributed.fused_allreduce:
one-shot, two-shot, and the routing of ``--all-reduce fused``).

Each point captures 20 back-to-back calls on one bf16 tensor in a CUDA graph (as decode runs
them) and times graph replays with CUDA events; the figure is the median per call. Every path's
result is checked against NCCL's (and NCCL + FlashInfer's norm) first. The fused rows treat the
message as [tokens, 5120] (Qwen3-32B's hidden size) where the size is a multiple of 10 KiB,
else as [tokens, 1024].

    python benchmarks/allreduce_latency.py --tp-size 2 --out out/allreduce.json
    python benchmarks/allreduce_latency.py --tp-size 2 --fused-only --out out/allreduce_fused.json
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpserve.distributed.comm import CudaCommunicator, init_process_groups, local_init_addr
from tpserve.distributed.peer_allreduce import BUFFER_BYTES, PeerAllReduce
from tpserve.plan.calibrate import time_in_graph

SIZES_KIB = [2, 10, 32, 80, 160, 320, 640, 1280, 2560, 5120, 8192, 20480, 81920]
REPEAT = 20
EPS = 1e-6


def time_graph(fn, x: torch.Tensor, iters: int = 30) -> float:
    """Median seconds per call of ``fn(x)`` over graph replays of REPEAT calls."""
    return time_in_graph(lambda: fn(x), iters, REPEAT, before_replay=dist.barrier)


def nccl(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def all_reduce_rows(comm: CudaCommunicator, one: PeerAllReduce, world: int, device: torch.device) -> list[dict]:
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
    return rows


def fused_rows(comm: CudaCommunicator, one: PeerAllReduce, rank: int, world: int, device: torch.device) -> list[dict]:
    """All-reduce + add + RMSNorm per call, apart and fused; every path works in place on
    (x, residual) as the decoder does: x becomes the normed output, residual the new residual."""
    from tpserve.distributed.fused_allreduce import MAX_BYTES, FusedAllReduceNorm
    from tpserve.kernels.flashinfer_ops import fused_add_rms_norm_
    from tpserve.layers.norm import RMSNorm

    group = dist.group.WORLD
    if comm.fused is None:
        raise RuntimeError("the fused all-reduce + RMSNorm did not start (see the warning above)")
    forced = {
        "fused_1s": FusedAllReduceNorm(group, device, torch.bfloat16, MAX_BYTES, one_shot_max_bytes=MAX_BYTES),
        "fused_2s": FusedAllReduceNorm(group, device, torch.bfloat16, MAX_BYTES, one_shot_max_bytes=0),
    }
    rows = []
    for kib in SIZES_KIB:
        numel = kib * 1024 // 2
        if numel * 2 > MAX_BYTES:
            continue
        hidden = 5120 if kib % 10 == 0 else 1024
        tokens = numel // hidden
        norm = RMSNorm(hidden, EPS).to(device=device, dtype=torch.bfloat16)
        gen = torch.Generator(device).manual_seed(rank)
        norm.weight.data.copy_(torch.rand(hidden, generator=gen, device=device) + 0.5)
        w = norm.weight.data
        base = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, generator=gen)
        res0 = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, generator=torch.Generator(device).manual_seed(7))

        def apart(reduce):
            return lambda x, r: fused_add_rms_norm_(reduce(x), r, w, EPS)

        paths = {
            "nccl+norm": apart(nccl),
            "one_shot+norm": apart(lambda x: one.one_shot(x)),
            "auto+norm": apart(comm.all_reduce),
            "fused_1s": lambda x, r: forced["fused_1s"](x, r, w, EPS),
            "fused_2s": lambda x, r: forced["fused_2s"](x, r, w, EPS),
            "fused": lambda x, r: comm.all_reduce_add_rmsnorm(x, r, norm),
        }
        want_x, want_r = paths["nccl+norm"](base.clone(), res0.clone())
        row: dict = {"size_kib": kib, "tokens": tokens, "hidden": hidden}
        x0, r0 = base.clone(), res0.clone()
        row["norm_only_us"] = time_graph(lambda _: fused_add_rms_norm_(x0, r0, w, EPS), None) * 1e6
        for name, fn in paths.items():
            if name == "fused_2s" and tokens <= world:
                continue  # two-shot splits the tokens between the ranks
            got_x, got_r = fn(base.clone(), res0.clone())
            for got, want, what in ((got_x, want_x, "normed"), (got_r, want_r, "residual")):
                if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=5e-2):
                    err = (got.float() - want.float()).abs().max().item()
                    raise AssertionError(f"{name} at {kib} KiB: {what} differs from NCCL + norm by up to {err}")
            x, r = base.clone(), res0.clone()
            row[f"{name}_us"] = time_graph(lambda _: fn(x, r), None) * 1e6
        rows.append(row)
    for f in forced.values():
        f.close()
    return rows


def rank_main(rank: int, world: int, addr: str, fused_only: bool, queue) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    comm, _ = init_process_groups(rank, world, addr, device, torch.bfloat16, "fused")
    assert isinstance(comm, CudaCommunicator)
    one = PeerAllReduce(dist.group.WORLD, device, torch.bfloat16, one_shot_max_bytes=BUFFER_BYTES)
    rows = [] if fused_only else all_reduce_rows(comm, one, world, device)
    fused = fused_rows(comm, one, rank, world, device)
    if rank == 0:
        queue.put((rows, fused))
    dist.barrier()
    one.close()
    comm.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--fused-only", action="store_true", help="only the all-reduce + add + RMSNorm rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from common import device_name, print_table, write_json

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(rank_main, args=(args.tp_size, local_init_addr(), args.fused_only, queue),
                       nprocs=args.tp_size, join=True, start_method="spawn")
    rows, fused = queue.get()
    for row in rows:
        fastest = min((v, k[:-3]) for k, v in row.items() if k.endswith("_us") and k != "auto_us")
        row["best"] = fastest[1]
        row["auto_vs_nccl"] = row["nccl_us"] / row["auto_us"]
    for row in fused:
        fastest = min((v, k[:-3]) for k, v in row.items() if k.endswith("_us") and k not in ("fused_us", "norm_only_us"))
        row["best"] = fastest[1]
        row["fused_vs_auto"] = row["auto+norm_us"] / row["fused_us"]
    where = f"TP {args.tp_size} on {device_name()}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}"
    if rows:
        print(f"\nAll-reduce latency (us per op, CUDA graph of {REPEAT}), {where}")
        print_table(rows, ["size_kib", "nccl_us", "one_shot_us", "two_shot_us", "auto_us", "auto_vs_nccl", "best"])
    print(f"\nAll-reduce + add + RMSNorm (us per call, CUDA graph of {REPEAT}), {where}")
    print_table(fused, ["size_kib", "tokens", "hidden", "norm_only_us", "nccl+norm_us", "one_shot+norm_us", "auto+norm_us",
                        "fused_1s_us", "fused_2s_us", "fused_us", "fused_vs_auto", "best"])
    write_json(args.out, {"benchmark": "allreduce_latency", "tp_size": args.tp_size, "rows": rows, "fused_rows": fused})


if __name__ == "__main__":
    main()
