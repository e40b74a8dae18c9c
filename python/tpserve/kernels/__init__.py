"""Fused GPU kernels for the decoder's small ops, the KV-cache store and sampling.

The layers' torch code is the CPU path and the reference. ``flashinfer`` and ``triton`` are
imported on first use, so the CPU install needs neither. ``TPSERVE_FUSED_KERNELS=0`` (read at
import) turns every fused path off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from importlib import import_module
from pathlib import Path
from types import ModuleType

import torch

from tpserve.config import FLASHINFER_DTYPES

logger = logging.getLogger(__name__)

ENV_SWITCH = "TPSERVE_FUSED_KERNELS"
ENABLED = os.environ.get(ENV_SWITCH, "1") != "0"


@functools.cache
def optional_import(name: str) -> ModuleType | None:
    """The module, or None (logged once) when it is missing or fails to import."""
    try:
        return import_module(name)
    except Exception as exc:  # noqa: BLE001 -- installed but broken counts as missing
        logger.warning("%s unavailable (%s: %s); using the torch path", name, type(exc).__name__, exc)
        return None


def jit_name(base: str, source: Path) -> str:
    """A JIT module name keyed by ``source``'s hash: FlashInfer loads a module of that name from its
    AOT directory unbuilt, so a prebuilt one of an older source (scripts/gpu_suite.sh) must not match."""
    return f"{base}_{hashlib.sha256(source.read_bytes()).hexdigest()[:12]}"


def use_flashinfer(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors of this device and dtype take FlashInfer's fused kernels."""
    return ENABLED and device.type == "cuda" and dtype in FLASHINFER_DTYPES and optional_import("flashinfer") is not None


def use_triton(device: torch.device) -> bool:
    """Whether tensors on this device take tpserve's Triton kernels."""
    return ENABLED and device.type == "cuda" and optional_import("triton") is not None


def use_fp8_triton(device: torch.device) -> bool:
    """Whether Triton kernels read FP8 weights on this device (CUDA sm89+)."""
    return use_triton(device) and torch.cuda.get_device_capability(device) >= (8, 9)


def use_fp8_gemm(device: torch.device, block_size: tuple[int, int], row_scales: bool = False) -> bool:
    """Whether FP8 linear weights stay FP8, else dequantized: Triton's GEMMs run (sm89+) and take the layout (block
    scales: input blocks % 16 == 0, so a K tile lies in one block; a scale a row (``row_scales``): any K, the row-wise
    GEMM masking its K tiles)."""
    return use_fp8_triton(device) and (row_scales or block_size[1] % 16 == 0)
