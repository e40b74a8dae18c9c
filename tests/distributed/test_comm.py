"""The Gloo communicator over two real processes: sums, gathers in rank order."""

from __future__ import annotations

import multiprocessing as mp

import torch
from tpserve.distributed.comm import init_process_groups, local_init_addr


def _rank(rank: int, addr: str, out: mp.Queue) -> None:
    comm, cpu_group = init_process_groups(rank, 2, addr, torch.device("cpu"))
    summed = comm.all_reduce(torch.full((2, 3), float(rank + 1)))
    gathered = comm.all_gather(torch.arange(4.0).view(2, 2) + 10 * rank)
    out.put((rank, summed, gathered, cpu_group is not None))
    torch.distributed.destroy_process_group()


def test_all_reduce_and_all_gather_two_ranks():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = local_init_addr()
    procs = [ctx.Process(target=_rank, args=(r, addr, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=60) for _ in range(2))
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    for _, summed, gathered, has_cpu_group in results:
        assert torch.equal(summed, torch.full((2, 3), 3.0))
        # Rank 0's columns, then rank 1's: the vocabulary order the LM head needs.
        assert torch.equal(gathered, torch.tensor([[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]]))
        assert has_cpu_group


def test_single_rank_needs_no_process_group():
    comm, cpu_group = init_process_groups(0, 1, "", torch.device("cpu"))
    x = torch.ones(3)
    assert comm.all_reduce(x) is x and comm.all_gather(x) is x and cpu_group is None
