"""Which LoRA adapter each of the layers' slots holds (``models/adapters.py`` fills them).

Every rank keeps the same book: loads and unloads reach all ranks at the same point of their schedule. An unloaded
adapter's slot is retired, not free, until the scheduler sees no request of it left (``release``): requests admitted
before the unload finish with the adapter they started with."""

from __future__ import annotations

from dataclasses import dataclass


class LoRASlotError(ValueError):
    """A load or unload that cannot be done (the name is taken or unknown, or no slot is free)."""


@dataclass(frozen=True)
class LoadedAdapter:
    slot: int
    # unique per load, for the prefix cache: an adapter loaded again under the same name shares no cached pages
    # with the one it replaced
    load_id: int
    path: str


class LoRASlots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # slots 1..capacity (0: the base model)
        self.loaded: dict[str, LoadedAdapter] = {}
        self.retired: set[int] = set()
        self._loads = 0

    def free_slot(self, name: str) -> int:
        """The lowest free slot for adapter ``name`` (which must not be loaded)."""
        if name in self.loaded:
            raise LoRASlotError(f"The lora adapter '{name}' has already been loaded.")
        if self.capacity == 0:
            raise LoRASlotError("LoRA is not enabled: start the server with --enable-lora (or LLM(enable_lora=True))")
        taken = {adapter.slot for adapter in self.loaded.values()} | self.retired
        free = next((slot for slot in range(1, self.capacity + 1) if slot not in taken), None)
        if free is None:
            busy = f" ({len(self.retired)} of them unloaded, still used by running requests)" if self.retired else ""
            raise LoRASlotError(f"no free LoRA slot for '{name}': all {self.capacity} hold adapters{busy}; unload one "
                                "or start with a larger --max-loras")
        return free

    def add(self, name: str, slot: int, path: str) -> LoadedAdapter:
        self._loads += 1
        self.loaded[name] = adapter = LoadedAdapter(slot, self._loads, path)
        return adapter

    def remove(self, name: str) -> int:
        """Unload ``name``: its slot is retired until ``release``."""
        adapter = self.loaded.pop(name, None)
        if adapter is None:
            raise LoRASlotError(f"The lora adapter '{name}' cannot be found.")
        self.retired.add(adapter.slot)
        return adapter.slot

    def release(self, slot: int) -> None:
        self.retired.discard(slot)
