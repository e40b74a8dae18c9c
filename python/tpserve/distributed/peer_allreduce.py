"""All-reduce of small messages through peer GPU memory (CUDA only; imported lazily).

torch's symmetric memory maps one buffer per rank into every peer (CUDA IPC over P2P, never NVLink
multicast). A message is copied into this rank's buffer, then one kernel, synchronised with its
peers through the buffer's signal pads, reduces it: one-shot (every rank sums every peer's whole
buffer: one step) or two-shot (each rank sums its slice, then gathers the others: half the bytes
per rank at TP 2). Larger messages, other dtypes and non-contiguous tensors go to NCCL. The
buffer's address is fixed and the kernels take no host decisions, so both work in CUDA graphs.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Measured by benchmarks/allreduce_latency.py on two H200s (2026-11-30, NVLS off): one-shot is
# the fastest up to 1.25 MiB (7.5 us at 2 KiB against NCCL's 10.2), two-shot from 2.5 MiB to
# 8 MiB (46 us against 52), NCCL as fast beyond (see docs/benchmarks.md).
ONE_SHOT_MAX_BYTES = 1536 * 1024
BUFFER_BYTES = 8 * 1024 * 1024


class PeerAllReduce:
    """One rank's symmetric buffer and the one-shot/two-shot reductions over it."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        dtype: torch.dtype,
        buffer_bytes: int = BUFFER_BYTES,
        one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.buffer = symm_mem.empty(buffer_bytes // dtype.itemsize, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(self.buffer, self.group_name)
        if handle is None:
            raise RuntimeError("symmetric memory rendezvous failed")
        self.dtype = dtype
        self.one_shot_max_numel = one_shot_max_bytes // dtype.itemsize
        ops = torch.ops.symm_mem
        self._one_shot_copy = getattr(ops, "one_shot_all_reduce_copy", None)
        self._one_shot = ops.one_shot_all_reduce
        self._two_shot_out = getattr(ops, "two_shot_all_reduce_out", None)
        self._two_shot_inplace = ops.two_shot_all_reduce_
        torch.cuda.synchronize(device)
        dist.barrier(group)

    def handles(self, x: torch.Tensor) -> bool:
        # 16-byte multiples keep the kernels on their vectorised path on every rank alike.
        return (
            x.dtype == self.dtype
            and x.is_contiguous()
            and x.numel() <= self.buffer.numel()
            and (x.numel() * x.element_size()) % 16 == 0
        )

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1)
        buf = self.buffer[: flat.numel()]
        if self._one_shot_copy is not None:  # copies x into the buffer inside the same kernel
            return self._one_shot_copy(buf, flat, "sum", self.group_name).view_as(x)
        buf.copy_(flat)
        return self._one_shot(buf, "sum", self.group_name).view_as(x)

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1)
        buf = self.buffer[: flat.numel()]
        buf.copy_(flat)
        if self._two_shot_out is not None:
            self._two_shot_out(buf, "sum", self.group_name, flat)
        else:
            self._two_shot_inplace(buf, "sum", self.group_name)
            flat.copy_(buf)
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.one_shot_max_numel:
            return self.one_shot(x)
        return self.two_shot(x)

    def close(self) -> None:
        self.buffer = None  # type: ignore[assignment]


def create_peer_all_reduce(
    mode: str, group: dist.ProcessGroup, cpu_group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype
) -> PeerAllReduce | None:
    """The peer all-reduce for ``mode``, or None (NCCL for every size). Every rank gets the same
    answer: if any rank cannot map peer memory, none uses it (a mix would deadlock)."""
    if mode == "nccl":
        return None
    one_shot_max = {"auto": ONE_SHOT_MAX_BYTES, "fused": ONE_SHOT_MAX_BYTES, "one_shot": BUFFER_BYTES, "two_shot": 0}[mode]
    peer: PeerAllReduce | None = None
    try:
        peer = PeerAllReduce(group, device, dtype, BUFFER_BYTES, one_shot_max)
    except Exception as exc:  # no P2P, no symmetric memory in this torch build, ...
        logger.warning("peer-memory all-reduce unavailable (%s: %s); using NCCL for every size", type(exc).__name__, exc)
    if not all_ranks(peer is not None, cpu_group) and peer is not None:
        logger.warning("another rank cannot use the peer-memory all-reduce; using NCCL for every size")
        peer.close()
        peer = None
    if peer is not None:
        logger.info(
            "TP all-reduce (%s): one-shot through peer memory up to %d KiB, two-shot up to %d KiB, NCCL above",
            mode, one_shot_max // 1024, BUFFER_BYTES // 1024,
        )
    return peer


def all_ranks(ok: bool, cpu_group: dist.ProcessGroup) -> bool:
    """Whether ``ok`` holds on every rank of ``cpu_group`` (a collective: every rank calls it)."""
    flag = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group)
    return bool(flag.item())
