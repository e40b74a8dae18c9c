"""Keeping Python's garbage collector out of the step loop.

A full (oldest-generation) collection scans every tracked object in the process: the imported
modules, the model's modules and whatever the run holds. On the GPU machine that is a pause of
about 0.3 s, and a long generation triggers several, each a stall of the whole pipeline (the
GPU idles while the scheduler is stopped). ``gc.freeze`` moves every object that exists now out
of the collector's view: they are still freed by reference counting, only no longer scanned.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_startup_heap() -> None:
    """For a process that serves until it exits: collect once, then freeze what start-up made."""
    gc.collect()
    gc.freeze()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze what exists for the duration of a run (no collection first: that would be a
    pause of its own), then hand it back to the collector."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
