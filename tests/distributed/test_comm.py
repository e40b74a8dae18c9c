"""The Gloo communicator over two real processes: sums, gathers in rank order."""

from __future__ import annotations

import pytest
import torch
from tpserve.distributed.comm import init_process_groups, local_init_addr
from tpserve.distributed.peer_allreduce import all_ranks
from tpserve.distributed.spawn import on_spawned_ranks
from tpserve.layers.norm import RMSNorm


def _norm() -> RMSNorm:
    norm = RMSNorm(3, 1e-6)
    norm.weight.data.copy_(torch.tensor([1.0, 2.0, 0.5]))
    return norm


def _rank(rank: int, addr: str) -> tuple:
    comm, cpu_group = init_process_groups(rank, 2, addr, torch.device("cpu"))
    summed = comm.all_reduce(torch.full((2, 3), float(rank + 1)))
    gathered = comm.all_gather(torch.arange(4.0).view(2, 2) + 10 * rank)
    partial = torch.arange(6.0).view(2, 3) * (rank + 1)
    normed = comm.all_reduce_add_rmsnorm(partial, torch.ones(2, 3), _norm())
    torch.distributed.destroy_process_group()
    # plain lists: a tensor sent through the queue is shared through a file descriptor, which may
    # be gone by the time the parent reads it if this process has exited
    return summed.tolist(), gathered.tolist(), [t.tolist() for t in normed], cpu_group is not None


def test_all_reduce_and_all_gather_two_ranks():
    results = on_spawned_ranks(_rank, 2, local_init_addr(), timeout_s=60)
    want = _norm()(torch.arange(6.0).view(2, 3) * 3, torch.ones(2, 3))
    for summed, gathered, normed, has_cpu_group in results:
        summed, gathered = torch.tensor(summed), torch.tensor(gathered)
        assert torch.equal(summed, torch.full((2, 3), 3.0))
        # the partial sums (1x and 2x) all-reduced, plus the residual, normalised
        assert torch.equal(torch.tensor(normed[0]), want[0]) and torch.equal(torch.tensor(normed[1]), want[1])
        # Rank 0's columns, then rank 1's: the vocabulary order the LM head needs.
        assert torch.equal(gathered, torch.tensor([[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]]))
        assert has_cpu_group


def _agree(rank: int, addr: str) -> tuple[bool, bool]:
    _, cpu_group = init_process_groups(rank, 2, addr, torch.device("cpu"))
    answers = all_ranks(True, cpu_group), all_ranks(rank == 0, cpu_group)
    torch.distributed.destroy_process_group()
    return answers


def test_all_ranks_holds_only_where_every_rank_says_so():
    assert on_spawned_ranks(_agree, 2, local_init_addr(), timeout_s=60) == [(True, False), (True, False)]


@pytest.fixture()
def world_of_one():
    torch.distributed.init_process_group("gloo", init_method=local_init_addr(), rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_single_rank_needs_no_process_group():
    comm, cpu_group = init_process_groups(0, 1, "", torch.device("cpu"))
    x = torch.ones(3)
    assert comm.all_reduce(x) is x and comm.all_gather(x) is x and cpu_group is None
    normed, residual = comm.all_reduce_add_rmsnorm(torch.ones(1, 3), torch.ones(1, 3), _norm())
    assert torch.equal(residual, torch.full((1, 3), 2.0)) and torch.allclose(normed, _norm().weight.data)


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


def test_cuda_communicator_routes_small_messages_to_the_peer_kernels(world_of_one):
    from tpserve.distributed.comm import CudaCommunicator

    peer = _FakePeer()
    comm = CudaCommunicator(1, peer)
    assert torch.equal(comm.all_reduce(torch.ones(4)), torch.full((4,), 2.0)) and peer.calls == 1
    assert torch.equal(comm.all_reduce(torch.ones(5)), torch.ones(5)) and peer.calls == 1  # the group's path
    comm.close()
    assert comm.peer is None


class _FakeFused:
    """Stands in for the GPU-only FusedAllReduceNorm: takes [tokens, hidden] of at most 2 tokens."""

    def __init__(self) -> None:
        self.calls = 0

    def handles(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return x.shape[0] <= 2

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return x * 0, residual * 0

    def close(self) -> None:
        pass


def test_cuda_communicator_sends_add_rmsnorm_through_the_fused_kernel_where_it_fits(world_of_one):
    from tpserve.distributed.comm import CudaCommunicator

    fused, peer = _FakeFused(), _FakePeer()
    comm = CudaCommunicator(1, peer, fused)
    normed, residual = comm.all_reduce_add_rmsnorm(torch.ones(2, 3), torch.ones(2, 3), _norm())
    assert fused.calls == 1 and peer.calls == 0 and not normed.any() and not residual.any()
    # too many tokens for the fused kernel: the peer all-reduce (x2 here), then the norm
    normed, residual = comm.all_reduce_add_rmsnorm(torch.ones(1, 3).expand(3, 3).contiguous(), torch.ones(3, 3), _norm())
    assert fused.calls == 1 and peer.calls == 0  # 9 elements: the group's all-reduce, not the peer's
    assert torch.equal(residual, torch.full((3, 3), 2.0))
    comm.close()
    assert comm.fused is None and comm.peer is None
    normed, residual = CudaCommunicator(1, None).all_reduce_add_rmsnorm(torch.ones(1, 3), torch.ones(1, 3), _norm())
    assert torch.equal(residual, torch.full((1, 3), 2.0))


def test_nccl_mode_makes_no_peer_buffers_and_comm_imports_no_gpu_module():
    import subprocess
    import sys

    from tpserve.distributed.peer_allreduce import create_peer_all_reduce

    assert create_peer_all_reduce("nccl", None, None, torch.device("cpu"), torch.bfloat16) is None
    code = (
        "import sys, tpserve.distributed.comm, tpserve.models.decoder; "
        "sys.exit(any(m in sys.modules for m in ('tpserve.distributed.peer_allreduce', 'tpserve.distributed.fused_allreduce')))"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
