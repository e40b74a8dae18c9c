"""Programmatic dependent launch (PDL, Hopper and newer): a kernel launched with it may start
while the previous kernel finishes, and waits for that kernel's writes where it reads them."""

from __future__ import annotations

import functools
import os

import torch

# ``0``: tpserve's Triton kernels launch without PDL (read at each launch, so a CUDA graph keeps
# what its capture saw).
TRITON_PDL_ENV = "TPSERVE_TRITON_PDL"


@functools.cache
def pdl_supported(device_index: int) -> bool:
    """Programmatic dependent launch (PDL): Hopper and newer."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def triton_has_gdc() -> bool:
    """Whether the installed Triton has grid dependency control (``tl.extra.cuda.gdc_wait``, 3.4+);
    older ones run tpserve's kernels without PDL."""
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


def triton_pdl(device: torch.device) -> bool:
    """Whether a Triton kernel on ``device`` launches with PDL. Such a kernel lets the next kernel
    launch once all its programs have started, and waits for the previous kernel's writes
    (``gdc_wait``) only before it reads them: its launch and first loads overlap the previous
    kernel's tail, and the next kernel's (a GEMV's weight loads) overlap its own run."""
    return (device.type == "cuda" and os.environ.get(TRITON_PDL_ENV, "1") != "0" and pdl_supported(device.index or 0)
            and triton_has_gdc())
