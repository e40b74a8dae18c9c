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


# PDL only where a launch is a decode step's: there a kernel takes a few microseconds and its launch and prologue
# are worth hiding. At prefill sizes it costs: Qwen3-30B-A3B's 8,192-token prefill step on an H200 took 1.107x
# with it (171.1 against 154.7 ms; the rotary + KV store kernel 19.0 against 9.6 ms, its programs launched early
# and held while attention's waited beside them; session 30, docs/results/history.md). 256: the CUDA graphs'
# largest batch by default, so decode steps keep what they were measured with.
PDL_MAX_ROWS = 256


def triton_pdl(device: torch.device, rows: int) -> bool:
    """Whether a Triton kernel over ``rows`` tokens (or sequences) on ``device`` launches with PDL. Such a kernel
    lets the next kernel launch once all its programs have started, and waits for the previous kernel's writes
    (``gdc_wait``) only before it reads them: its launch and first loads overlap the previous kernel's tail, and
    the next kernel's (a GEMV's weight loads) overlap its own run."""
    return (device.type == "cuda" and rows <= PDL_MAX_ROWS and os.environ.get(TRITON_PDL_ENV, "1") != "0"
            and pdl_supported(device.index or 0) and triton_has_gdc())
