"""LoRASlots: the loaded adapters and which slot holds each: a slot holding the adapter, else the lowest free one,
else the least recently used one no admitted request uses."""

from __future__ import annotations

import pytest

from tpserve.engine.lora_slots import LoRASlotError, LoRASlots
from tpserve.engine_config import EngineConfig
from tpserve.models.adapters import AdapterWeights

NONE = AdapterWeights(())


def test_slots_are_reused_least_recently_used_first_and_never_while_busy():
    slots = LoRASlots(2)
    a, b, c = (slots.add(name, f"/{name}", NONE) for name in "abc")
    with pytest.raises(LoRASlotError, match="The lora adapter 'a' has already been loaded."):
        slots.add("a", "/a", NONE)
    assert slots.slot_for(a, busy=()) == 1 and slots.place(1, a)
    assert slots.slot_for(b, busy={1}) == 2 and slots.place(2, b)
    assert slots.slot_for(a, busy={1, 2}) == 1 and not slots.place(1, a), "a is there: nothing to copy"
    assert slots.slot_for(c, busy={1, 2}) is None, "every slot busy: c waits"
    assert slots.slot_for(c, busy={1}) == 2
    assert slots.slot_for(c, busy=()) == 2, "b was used longer ago than a"
    assert slots.place(2, c) and slots.holders == {1: a, 2: c}


def test_unloaded_adapters_keep_their_slot_until_released():
    slots = LoRASlots(1)
    a = slots.add("a", "/a", NONE)
    slots.place(1, a)
    assert slots.remove("a") is a and slots.unloaded_slots() == [1]
    with pytest.raises(LoRASlotError, match="The lora adapter 'a' cannot be found."):
        slots.remove("a")
    again = slots.add("a", "/a", NONE)
    assert again.load_id != a.load_id and slots.slot_for(again, busy={1}) is None
    slots.release(1)
    assert not slots.unloaded_slots() and slots.slot_for(again, busy=()) == 1
    with pytest.raises(LoRASlotError, match="LoRA is not enabled"):
        LoRASlots(0).add("a", "/a", NONE)


def test_slot_count_is_max_loras():
    """vLLM's --max-loras (default 1): the adapters one batch may use; any number more are loaded."""
    assert EngineConfig(model="/m").lora_slots == 0
    assert EngineConfig(model="/m", enable_lora=True).lora_slots == 1
    assert EngineConfig(model="/m", enable_lora=True, max_loras=3).lora_slots == 3
    assert EngineConfig(model="/m", lora_modules={"a": "/a", "b": "/b"}).lora_slots == 1
    assert EngineConfig(model="/m", lora_modules={"a": "/a"}, max_loras=4).lora_slots == 4
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(model="/m", max_loras=0)
