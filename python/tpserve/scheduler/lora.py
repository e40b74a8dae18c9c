"""The scheduler's LoRA adapters (mixed into ``Scheduler``): loads and unloads at run time, at the same point of every
rank's schedule, and the slots admitted requests hold (``engine/lora_slots.py`` keeps the book)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections import deque

    from tpserve.engine.engine import Engine
    from tpserve.scheduler.request import Request
    from tpserve.scheduler.scheduler import _Launched
    from tpserve.structured.waitlist import GrammarWaitlist

logger = logging.getLogger(__name__)


class LoRAScheduling:
    engine: Engine
    running: dict[int, Request]
    waiting: deque[Request]
    compiling: GrammarWaitlist[Request]
    inflight: _Launched | None

    def load_lora(self, name: str, path: str) -> None:
        """Load an adapter (into host memory; a slot when a request needs it); a ValueError says why it cannot be."""
        self.engine.load_lora(name, path)
        logger.info("LoRA adapter %r loaded from %s", name, path)

    def unload_lora(self, name: str) -> None:
        """New requests may no longer name the adapter; those that did finish with it, and its slot is free once
        no admitted request uses it."""
        self.engine.loras.remove(name)
        self._release_lora_slots()
        logger.info("LoRA adapter %r unloaded", name)

    def _release_lora_slots(self) -> None:
        """Free the slots of unloaded adapters that no admitted request (running or in flight) uses."""
        unloaded = self.engine.loras.unloaded_slots()
        if unloaded:
            busy = self._busy_lora_slots()
            for slot in unloaded:
                if slot not in busy:
                    self.engine.release_lora_slot(slot)

    def _busy_lora_slots(self) -> set[int]:
        """The adapter slots admitted requests use: their adapters stay put while they run."""
        busy = {req.lora_slot for req in self.running.values()}
        if self.inflight is not None:  # a request aborted with a step in flight: that step still reads its slot
            busy.update(req.lora_slot for req, _ in self.inflight.entries)
        return busy

    def _lora_stats(self) -> dict[str, list[str]]:
        if not self.engine.loras.capacity:
            return {}
        waiting = (*self.waiting, *self.compiling.requests())
        return {"running_loras": sorted({req.adapter.name for req in self.running.values() if req.adapter}),
                "waiting_loras": sorted({req.adapter.name for req in waiting if req.adapter})}
