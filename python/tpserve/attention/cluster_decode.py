"""Split-KV decode attention whose splits merge inside a thread-block cluster (``kernels/csrc/cluster_decode.cu``,
Hopper), over the dense page table the Triton kernel reads (``attention/page_table.py``).

An experiment against ``attention/triton_decode.py`` at small batches: ``TPSERVE_DECODE_CLUSTER=C`` (1 to 16
blocks a sequence's KV head, read when the attention backend is built) puts it where the Triton kernel would run.
The Triton kernel's splits merge through global memory (partials, an atomic counter, the last program reading them
back); here a cluster's blocks read each other's shared memory after a cluster barrier.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Any

import torch

from tpserve.attention.page_table import TableMetadata
from tpserve.kernels import jit_name
from tpserve.kernels.pdl import pdl_supported
from tpserve.kernels.settings import int_settings

SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "csrc" / "cluster_decode.cu"
CLUSTER_ENV = "TPSERVE_DECODE_CLUSTER"
# A variant of the kernel's constants (csrc/cluster_decode.cu's TPSERVE_DECODE_* macros), e.g. ``THREADS=128 TOKENS=4``,
# built as a module of its own (read where the backend is built).
DEFINES_ENV = "TPSERVE_DECODE_CLUSTER_DEFINES"
HEAD_DIM = 128
MAX_GROUP = 8
MAX_SPLITS = 16


def splits_from_env() -> int:
    """``TPSERVE_DECODE_CLUSTER``: blocks a cluster (0 or unset: the kernel is off)."""
    value = os.environ.get(CLUSTER_ENV, "0")
    if not value.isdigit() or int(value) > MAX_SPLITS:
        raise ValueError(f"{CLUSTER_ENV}={value!r}: blocks a cluster, 0 (off) to {MAX_SPLITS}")
    return int(value)


def unsupported_reason(head_dim: int, num_heads: int, num_kv_heads: int, fp8_cache: bool,
                       dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernel cannot take this cache layout, or None when it can."""
    if fp8_cache or dtype != torch.bfloat16:
        return "the cluster decode kernel reads bfloat16 pages only"
    if head_dim != HEAD_DIM:
        return f"the cluster decode kernel takes head_dim {HEAD_DIM}, not {head_dim}"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return (f"the cluster decode kernel takes up to {MAX_GROUP} query heads a KV head, "
                f"not {num_heads}:{num_kv_heads}")
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return "the cluster decode kernel runs on Hopper (sm90) only"
    return None


def jit_spec(defines: tuple[tuple[str, int], ...] = ()) -> Any:
    from flashinfer.jit.core import current_compilation_context, gen_jit_spec

    flags = current_compilation_context.get_nvcc_flags_list(supported_major_versions=[9])
    flags += [f"-DTPSERVE_DECODE_{name}={value}" for name, value in defines]
    name = jit_name("tpserve_cluster_decode", SOURCE) + "".join(f"_{name.lower()}{value}" for name, value in defines)
    return gen_jit_spec(name, [SOURCE], extra_cuda_cflags=flags)


@functools.cache
def load_module(defines: tuple[tuple[str, int], ...] = ()) -> Any:
    return jit_spec(defines).build_and_load()


class ClusterDecode:
    """The kernel over one engine's cache (``TableDecodeKernel``)."""

    name = "tpserve's cluster split-KV"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, device: torch.device,
                 splits: int, defines: str | None = None) -> None:
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"cluster decode: splits must be 1 to {MAX_SPLITS}, not {splits}")
        self.splits = splits
        self.scale_log2 = scale * math.log2(math.e)
        self.pdl = pdl_supported(device.index or 0)
        defines = os.environ.get(DEFINES_ENV, "") if defines is None else defines
        self.module = load_module(int_settings(defines, DEFINES_ENV))

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TableMetadata) -> torch.Tensor:
        """out [B, Hq, D] of q [B, Hq, D] over the caches [pages, page_size, Hkv, D]."""
        out = torch.empty_like(q)
        self.module.cluster_decode(q, k_cache, v_cache, meta.page_table, meta.seq_lens, out, self.scale_log2,
                                   self.splits, self.pdl)
        return out
