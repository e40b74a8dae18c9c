"""LoRASlots: which adapter each layer slot holds, unloaded slots retired until released."""

from __future__ import annotations

import pytest

from tpserve.engine.lora_slots import LoRASlots, LoRASlotError
from tpserve.engine_config import EngineConfig


def test_slots_are_taken_lowest_first_and_retired_until_released():
    slots = LoRASlots(2)
    assert slots.add("a", slots.free_slot("a"), "/a").slot == 1
    with pytest.raises(LoRASlotError, match="The lora adapter 'a' has already been loaded."):
        slots.free_slot("a")
    assert slots.add("b", slots.free_slot("b"), "/b").slot == 2
    with pytest.raises(LoRASlotError, match=r"no free LoRA slot for 'c': all 2 hold adapters; .*--max-loras"):
        slots.free_slot("c")
    assert slots.remove("a") == 1 and "a" not in slots.loaded
    with pytest.raises(LoRASlotError, match=r"1 of them unloaded, still used by running requests"):
        slots.free_slot("c")
    with pytest.raises(LoRASlotError, match="The lora adapter 'a' cannot be found."):
        slots.remove("a")
    slots.release(1)
    again = slots.add("a", slots.free_slot("a"), "/a")
    assert again.slot == 1 and again.load_id == 3, "each load its own id (its prefix-cache key)"


def test_no_slots_without_lora():
    with pytest.raises(LoRASlotError, match="LoRA is not enabled"):
        LoRASlots(0).free_slot("a")


def test_slot_count_is_max_loras_and_at_least_the_start_adapters():
    """vLLM's --max-loras (default 1); tpserve has no CPU cache to swap adapters through, so the --lora-modules
    adapters each keep a slot."""
    assert EngineConfig(model="/m").lora_slots == 0
    assert EngineConfig(model="/m", enable_lora=True).lora_slots == 1
    assert EngineConfig(model="/m", enable_lora=True, max_loras=3).lora_slots == 3
    assert EngineConfig(model="/m", lora_modules={"a": "/a", "b": "/b"}).lora_slots == 2
    assert EngineConfig(model="/m", lora_modules={"a": "/a"}, max_loras=4).lora_slots == 4
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(model="/m", max_loras=0)
