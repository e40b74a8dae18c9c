"""Fused GPU kernels for the decoder's small ops, the KV-cache store and sampling.

The layers keep their torch code as the CPU path and as the reference; on a CUDA tensor of a
supported dtype they call these instead. ``flashinfer`` and ``triton`` are imported on first use,
never when this package is imported, so the CPU install needs neither.

``TPSERVE_FUSED_KERNELS=0`` in the environment (read once, when this module is imported) turns
every fused path off, e.g. to measure or test against the torch path.
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
    """The name of a module built from ``source`` through FlashInfer's JIT, keyed by the source's
    hash: FlashInfer loads a module of that name from its AOT directory without rebuilding it, so
    a carried prebuilt module of an older source must not match (scripts/gpu_suite.sh packs them)."""
    return f"{base}_{hashlib.sha256(source.read_bytes()).hexdigest()[:12]}"


def use_flashinfer(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tensors of this device and dtype take FlashInfer's fused kernels."""
    return ENABLED and device.type == "cuda" and dtype in FLASHINFER_DTYPES and optional_import("flashinfer") is not None


def use_triton(device: torch.device) -> bool:
    """Whether tensors on this device take tpserve's Triton kernels."""
    return ENABLED and device.type == "cuda" and optional_import("triton") is not None


def use_fp8_gemm(device: torch.device, block_size: tuple[int, int]) -> bool:
    """Whether FP8 weights with these blocks stay FP8 on this device (Triton's FP8 GEMM: compute
    capability 8.9+, input blocks a multiple of 16); elsewhere they are dequantized at load."""
    return (
        use_triton(device) and torch.cuda.get_device_capability(device) >= (8, 9) and block_size[1] % 16 == 0
    )
