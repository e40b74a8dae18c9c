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


class _FakePeer:
    """Stands in for the GPU-only PeerAllReduce: takes tensors of at most 4 elements."""

    def __init__(self) -> None:
        self.calls = 0

    def handles(self, x: torch.Tensor) -> bool:
        return x.numel() <= 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 2

    def close(self) -> None:
        pass


def test_cuda_communicator_routes_small_messages_to_the_peer_kernels():
    from tpserve.distributed.comm import CudaCommunicator

    torch.distributed.init_process_group("gloo", init_method=local_init_addr(), rank=0, world_size=1)
    try:
        peer = _FakePeer()
        comm = CudaCommunicator(1, peer)
        assert torch.equal(comm.all_reduce(torch.ones(4)), torch.full((4,), 2.0)) and peer.calls == 1
        assert torch.equal(comm.all_reduce(torch.ones(5)), torch.ones(5)) and peer.calls == 1  # the group's path
        comm.close()
        assert comm.peer is None
    finally:
        torch.distributed.destroy_process_group()


def test_nccl_mode_makes_no_peer_buffers_and_comm_imports_no_gpu_module():
    import subprocess
    import sys

    from tpserve.distributed.peer_allreduce import create_peer_all_reduce

    assert create_peer_all_reduce("nccl", None, None, torch.device("cpu"), torch.bfloat16) is None
    code = "import sys, tpserve.distributed.comm; sys.exit('tpserve.distributed.peer_allreduce' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
