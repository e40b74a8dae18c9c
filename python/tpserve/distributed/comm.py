"""The collectives the parallel layers use, behind one ``Communicator`` interface: Gloo on CPU;
on GPU NCCL, small all-reduces through peer memory (``peer_allreduce``) and, with
``--all-reduce fused``, all-reduce + residual add + RMSNorm in one kernel (``fused_allreduce``)."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from tpserve.distributed.fused_allreduce import FusedAllReduceNorm
    from tpserve.distributed.peer_allreduce import PeerAllReduce
    from tpserve.layers.norm import RMSNorm


class Communicator(Protocol):
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension."""
        ...

    def all_reduce_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum ``x`` over the ranks, add ``residual``, normalise: (normed, new residual), with the
        in-place contract of ``RMSNorm``'s fused add (``x`` and ``residual`` may be overwritten)."""
        ...


# torch 2.13 renamed all_gather_into_tensor (gathers along dim 0) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class SingleRankCommunicator:
    world_size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_reduce_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm(x, residual)


class TorchDistCommunicator:
    """torch.distributed on the default (device) group: Gloo on CPU, NCCL on GPU."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x)
        return torch.cat(out.chunk(self.world_size, dim=0), dim=-1)

    def all_reduce_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm(self.all_reduce(x), residual)


class CudaCommunicator(TorchDistCommunicator):
    """NCCL, except for the all-reduces the peer-memory kernels or (followed by add + RMSNorm)
    the fused kernel handle."""

    def __init__(
        self, world_size: int, peer: PeerAllReduce | None, fused: FusedAllReduceNorm | None = None
    ) -> None:
        super().__init__(world_size)
        self.peer = peer
        self.fused = fused

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.peer is not None and self.peer.handles(x):
            return self.peer(x)
        return super().all_reduce(x)

    def all_reduce_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None and self.fused.handles(x, residual):
            return self.fused(x, residual, norm.weight, norm.eps)
        return super().all_reduce_add_rmsnorm(x, residual, norm)

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        if self.fused is not None:
            self.fused.close()
            self.fused = None


def free_port() -> int:
    """A free TCP port on loopback, picked by the parent and handed to every rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_init_addr() -> str:
    """A fresh ``tcp://127.0.0.1:PORT`` for a new group of ranks on this host."""
    return f"tcp://127.0.0.1:{free_port()}"


def init_process_groups(
    rank: int,
    world_size: int,
    init_addr: str,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    all_reduce: str = "auto",
    store: dist.Store | None = None,
    timeout_s: float | None = None,
) -> tuple[Communicator, dist.ProcessGroup | None]:
    """Returns (the tensor communicator, a Gloo CPU group for control messages); on CPU one Gloo
    group serves both. ``all_reduce`` picks the GPU's peer-memory/fused kernels; multi-node passes
    the ``store`` it joined and ``timeout_s``, the limit on every collective (torch's default otherwise)."""
    if world_size == 1:
        return SingleRankCommunicator(), None
    backend = "nccl" if device.type == "cuda" else "gloo"
    if store is None:
        store = rendezvous_store(init_addr, rank, world_size)
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        device_id=device if device.type == "cuda" else None,
        timeout=timeout,
    )
    if backend == "gloo":
        return TorchDistCommunicator(world_size), dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    from tpserve.distributed.peer_allreduce import create_peer_all_reduce

    peer = create_peer_all_reduce(all_reduce, dist.group.WORLD, cpu_group, device, dtype)
    fused = None
    if all_reduce == "fused":
        from tpserve.distributed.fused_allreduce import MAX_BYTES, ONE_SHOT_MAX_BYTES, create_fused_all_reduce

        fused = create_fused_all_reduce(dist.group.WORLD, cpu_group, device, dtype, MAX_BYTES, ONE_SHOT_MAX_BYTES)
    return CudaCommunicator(world_size, peer, fused), cpu_group


RENDEZVOUS_TIMEOUT_S = 300.0


def _wait_until_listening(host: str, port: int, timeout_s: float) -> None:
    """Plain connects until rank 0's store listens: torch's TCPStore client logs every failed try with its
    C++ stack frames, pages of them before the caller's one-line error."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:g} s") from None
            time.sleep(0.25)


def rendezvous_store(
    init_addr: str, rank: int, world_size: int, timeout_s: float = RENDEZVOUS_TIMEOUT_S, wait_for_workers: bool = True
) -> dist.TCPStore:
    """The ranks' key-value store, listening only on ``init_addr``'s host: torch's own ``tcp://``
    rendezvous makes rank 0's store listen, unauthenticated, on every interface. Gloo's and NCCL's
    sockets follow onto loopback too unless the user chose another interface."""
    url = urlsplit(init_addr)
    host, port = url.hostname or "127.0.0.1", url.port
    if port is None:
        raise ValueError(f"dist_init_addr must be tcp://HOST:PORT, got {init_addr!r}")
    if host in ("127.0.0.1", "localhost", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        _wait_until_listening(host, port, timeout_s)
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout,
                             wait_for_workers=wait_for_workers)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen()
    # detach: the store owns the descriptor from now on (closing the Python socket would close it)
    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.detach(),
        wait_for_workers=wait_for_workers,
    )
