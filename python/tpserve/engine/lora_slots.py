"""The LoRA adapters an engine serves and which of the layers' slots holds each (``models/adapters.py`` fills them).

As vLLM's: any number of adapters are loaded (each kept in host memory, this rank's shard), and ``--max-loras`` slots
on the device hold those a step's batch may use. A waiting request is admitted once its adapter has a slot: the one
holding it, a free one, or the least recently used one no admitted request uses (its adapter is copied in again when
next needed). Every rank keeps the same book: loads, unloads and admissions happen at the same point of each rank's
schedule. An unloaded adapter stays with the requests that arrived before the unload, until they finish."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tpserve.models.adapters import AdapterWeights


class LoRASlotError(ValueError):
    """A load or unload that cannot be done (the name is taken or unknown, or LoRA is not enabled)."""


@dataclass(frozen=True, eq=False)
class LoadedAdapter:
    name: str
    # unique per load, for the prefix cache: an adapter loaded again under the same name shares no cached pages
    # with the one it replaced
    load_id: int
    path: str
    weights: AdapterWeights  # this rank's shard, in host memory


class LoRASlots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # slots 1..capacity (0: the base model)
        self.loaded: dict[str, LoadedAdapter] = {}
        self.holders: dict[int, LoadedAdapter] = {}  # slot -> the adapter copied into it
        self._last_used: dict[int, int] = {}  # slot -> when a request was last admitted with it
        self._loads = 0
        self._clock = 0

    def check_new(self, name: str) -> None:
        if self.capacity == 0:
            raise LoRASlotError("LoRA is not enabled: start the server with --enable-lora (or LLM(enable_lora=True))")
        if name in self.loaded:
            raise LoRASlotError(f"The lora adapter '{name}' has already been loaded.")

    def add(self, name: str, path: str, weights: AdapterWeights) -> LoadedAdapter:
        self.check_new(name)
        self._loads += 1
        self.loaded[name] = adapter = LoadedAdapter(name, self._loads, path, weights)
        return adapter

    def remove(self, name: str) -> LoadedAdapter:
        """Unload ``name``: new requests may no longer name it (those that did keep it)."""
        adapter = self.loaded.pop(name, None)
        if adapter is None:
            raise LoRASlotError(f"The lora adapter '{name}' cannot be found.")
        return adapter

    def slot_for(self, adapter: LoadedAdapter, busy: Collection[int]) -> int | None:
        """The slot ``adapter`` would take now: the one holding it, else the lowest free one, else the least
        recently used one outside ``busy`` (the slots admitted requests use); None while every slot is busy."""
        for slot, holder in self.holders.items():
            if holder is adapter:
                return slot
        free = [slot for slot in range(1, self.capacity + 1) if slot not in self.holders]
        if free:
            return free[0]
        idle = [slot for slot in self.holders if slot not in busy]
        return min(idle, key=self._last_used.__getitem__) if idle else None

    def place(self, slot: int, adapter: LoadedAdapter) -> bool:
        """Note ``adapter`` in ``slot`` (used now); True when it was not there before, so its weights need copying."""
        self._clock += 1
        self._last_used[slot] = self._clock
        new = self.holders.get(slot) is not adapter
        self.holders[slot] = adapter
        return new

    def release(self, slot: int) -> None:
        """``slot`` is free again (its adapter was unloaded and no request uses it)."""
        self.holders.pop(slot, None)
        self._last_used.pop(slot, None)

    def unloaded_slots(self) -> list[int]:
        """Slots holding an adapter that has been unloaded (freed once no request uses them)."""
        return sorted(slot for slot, holder in self.holders.items() if self.loaded.get(holder.name) is not holder)
