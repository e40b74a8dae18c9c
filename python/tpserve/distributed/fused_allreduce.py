"""The TP all-reduce fused with the residual add and RMSNorm (CUDA only; imported lazily).

One kernel (``kernels/csrc/allreduce_rmsnorm.cu``: FlashInfer's port of TensorRT-LLM's all-reduce
fusion, built with only this pattern) does all three through peer GPU memory:

* one-shot (Lamport): every rank writes its partial sum into every peer's buffer and polls its own
  until no element is still -0.0 (the cleared value; writers turn -0.0 into +0.0), so no barrier
  is needed. Three buffers rotate: a call clears the one its predecessor read.
* two-shot: each rank sums and normalises its share of the tokens, then all-gathers them, with
  flag barriers between the steps.

The buffers are torch symmetric memory (CUDA IPC over P2P, never NVLink multicast). The kernels
keep their state (buffer index, barrier flags) in device memory only, so they work in CUDA graphs.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tpserve.distributed.peer_allreduce import BUFFER_BYTES, ONE_SHOT_MAX_BYTES, all_ranks

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "csrc" / "allreduce_rmsnorm.cu"
BARRIER_FLAG_COUNT = 256  # the kernel's flag slots per rank (details::kBarrierFlagCount)
VEC_BYTES = 16  # the kernel's bytes per access
RANKS = (2, 4, 8)
# Fused up to the peer all-reduce's buffer, one-shot up to its one-shot limit (to be set by
# benchmarks/allreduce_latency.py's fused rows).
MAX_BYTES = BUFFER_BYTES


def jit_spec() -> Any:
    """FlashInfer's JIT spec of the kernel (scripts/build_flashinfer_aot.sh prebuilds it)."""
    from flashinfer.jit.core import current_compilation_context, gen_jit_spec

    from tpserve.kernels import jit_name

    # the architectures FlashInfer builds its own trtllm_comm module for (Hopper and newer)
    flags = current_compilation_context.get_nvcc_flags_list(supported_major_versions=[9, 10, 12])
    return gen_jit_spec(jit_name("tpserve_allreduce_rmsnorm", SOURCE), [SOURCE], extra_cuda_cflags=flags)


@functools.cache
def load_module() -> Any:
    """Compile (first time; cached under FlashInfer's JIT directory) and load the kernel."""
    return jit_spec().build_and_load()


class FusedAllReduceNorm:
    """One rank's workspace for the fused all-reduce + add + RMSNorm, for messages up to
    ``max_bytes`` of ``dtype``; one-shot up to ``one_shot_max_bytes``, two-shot above."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        dtype: torch.dtype,
        max_bytes: int,
        one_shot_max_bytes: int,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if self.world_size not in RANKS:
            raise ValueError(f"the fused all-reduce runs on {RANKS} ranks, not {self.world_size}")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"the fused all-reduce takes bf16 or fp16, not {dtype}")
        self.module = load_module()  # built by create_fused_all_reduce first
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.one_shot_max_numel = one_shot_max_bytes // dtype.itemsize
        lamport_bytes = self.world_size * max_bytes  # one rotating buffer: every rank's message
        if 3 * lamport_bytes >= 2**31:
            raise ValueError(f"fused all-reduce buffers of {3 * lamport_bytes} bytes exceed the kernel's int32 offsets")
        sizes = {
            "two_shot": (2 * self.max_numel, dtype),  # the inputs, then the reduced shares
            "flags": (self.world_size * BARRIER_FLAG_COUNT, torch.int32),
            "lamport": (3 * lamport_bytes // dtype.itemsize, dtype),
        }
        self.buffers: dict[str, torch.Tensor] = {}
        ptrs: list[int] = []
        for name, (numel, buf_dtype) in sizes.items():
            buf = symm_mem.empty(numel, dtype=buf_dtype, device=device)
            handle = symm_mem.rendezvous(buf, group.group_name)
            if handle is None:
                raise RuntimeError("symmetric memory rendezvous failed")
            if name == "flags":
                buf.zero_()
            elif name == "lamport":
                buf.fill_(-0.0)  # "not written yet" (see the module docstring)
            self.buffers[name] = buf
            ptrs += [handle.get_buffer(peer, (numel,), buf_dtype).data_ptr() for peer in range(self.world_size)]
        # [read counter, two-shot flag, Lamport buffer index, Lamport buffer bytes, bytes to clear]
        self.control = torch.tensor([0, 0, 0, lamport_bytes, 0], dtype=torch.int32, device=device)
        self.workspace = torch.tensor([*ptrs, self.control.data_ptr()], dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group)

    def handles(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        hidden = x.shape[-1]
        return (
            x.dtype == self.dtype
            and x.dim() == 2
            and x.is_contiguous()
            and residual.shape == x.shape
            and residual.is_contiguous()
            and 0 < x.numel() <= self.max_numel
            and (hidden * x.element_size()) % VEC_BYTES == 0
            and hidden * x.element_size() // VEC_BYTES <= 8 * 1024  # a token's threads fit one cluster
        )

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place, as FlashInfer's fused add+RMSNorm: ``x`` (this rank's partial sum) becomes the
        normed output and ``residual`` the summed output plus the old residual."""
        # Two-shot splits the tokens between the ranks, so it needs more tokens than ranks.
        one_shot = x.numel() <= self.one_shot_max_numel or x.shape[0] <= self.world_size
        self.module.allreduce_add_rmsnorm(
            x, residual, x, weight, eps, self.workspace, self.world_size, self.rank, one_shot
        )
        return x, residual

    def close(self) -> None:
        self.buffers = {}


def create_fused_all_reduce(
    group: dist.ProcessGroup,
    cpu_group: dist.ProcessGroup,
    device: torch.device,
    dtype: torch.dtype,
    max_bytes: int,
    one_shot_max_bytes: int,
) -> FusedAllReduceNorm | None:
    """The fused all-reduce + RMSNorm, or None on every rank if any rank cannot set it up (a mix
    would deadlock)."""
    fused: FusedAllReduceNorm | None = None
    # The kernel is built before any collective step, so that a rank whose build fails cannot
    # leave its peers waiting in the buffers' rendezvous; each step then agrees across ranks.
    for step in ("build", "buffers"):
        try:
            if step == "build":
                load_module()
            else:
                fused = FusedAllReduceNorm(group, device, dtype, max_bytes, one_shot_max_bytes)
            ok = True
        except Exception as exc:  # no nvcc for the first build, no P2P, an unsupported world size, ...
            logger.warning("fused all-reduce + RMSNorm unavailable (%s: %s); all-reduce and norm run apart", type(exc).__name__, exc)
            ok = False
        if not all_ranks(ok, cpu_group):
            if fused is not None:
                fused.close()
            return None
    if fused is not None:
        logger.info(
            "TP all-reduce + add + RMSNorm fused up to %d KiB (one-shot up to %d KiB)", max_bytes // 1024, one_shot_max_bytes // 1024
        )
    return fused

