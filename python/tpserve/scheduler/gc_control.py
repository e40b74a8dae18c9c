"""Keeping Python's garbage collector out of the step loop.

A full collection scans every tracked object (modules, the model, the run's state): about 0.3 s on
the GPU machine, several per long generation, each idling the GPU. ``gc.freeze`` takes what exists
now out of the collector's view (reference counting still frees it).
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
    """Freeze what exists for a run (no collection first: a pause of its own), then unfreeze; where the caller
    froze the heap already, its freeze is left as it is (unfreezing would undo it)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
