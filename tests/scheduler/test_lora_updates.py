"""LoRA adapters loaded and unloaded at run time on one rank (a real engine, float32 on the CPU): more adapters than
slots take turns in them (a waiting request's adapter gets a slot no admitted request uses; the requests behind it go
on); an unload with a request of the adapter running lets it finish with the adapter (PEFT's tokens), keeps the slot
until then; and a reloaded adapter shares no cached prefix with the one it replaced."""

from __future__ import annotations

import pytest
import torch
from msgspec.structs import replace

from tpserve.engine.engine import Engine
from tpserve.engine_config import EngineConfig
from tpserve.engine.lora_slots import LoRASlotError
from tpserve.sampling_params import SamplingParams
from tpserve.scheduler.scheduler import AdmissionError, Scheduler

PROMPT = list(range(10, 30))  # 20 tokens: a whole page of 16 to cache
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(qwen3_dir, tmp_path_factory) -> dict[str, str]:
    from lora_adapters import make_adapter

    all_layers = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {"all": make_adapter(qwen3_dir, str(tmp_path_factory.mktemp("all")), all_layers),
            "qv": make_adapter(qwen3_dir, str(tmp_path_factory.mktemp("qv")), ("q_proj", "v_proj"), rank=8, seed=3)}


def run_until_done(scheduler: Scheduler, tokens: dict[int, list[int]], cached: dict[int, int]) -> None:
    while scheduler.has_work:
        for out in scheduler.step():
            tokens.setdefault(out.rid, []).extend(out.token_ids)
            cached[out.rid] = max(cached.get(out.rid, 0), out.cached_tokens)


def test_unload_while_running_then_reload(qwen3_dir, adapters):
    from lora_adapters import peft_greedy

    engine = Engine(EngineConfig(model=qwen3_dir, device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8))
    scheduler = Scheduler(engine)
    scheduler.check_accounting = True
    with pytest.raises(AdmissionError, match="LoRA adapter 'all' is not loaded"):
        scheduler.add_request(1, PROMPT, SamplingParams(lora="all"), seed=1)
    scheduler.load_lora("all", adapters["all"])
    with pytest.raises(LoRASlotError, match="already been loaded"):
        scheduler.load_lora("all", adapters["all"])
    scheduler.add_request(1, PROMPT, replace(GREEDY, lora="all"), seed=1)
    tokens: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    for _ in range(3):  # prefilled and decoding
        for out in scheduler.step():
            tokens.setdefault(out.rid, []).extend(out.token_ids)
    scheduler.unload_lora("all")
    assert engine.loras.unloaded_slots() == [1], "its slot stays while its request runs"
    with pytest.raises(AdmissionError, match="LoRA adapter 'all' is not loaded"):
        scheduler.add_request(2, PROMPT, SamplingParams(lora="all"), seed=2)
    with pytest.raises(LoRASlotError, match="The lora adapter 'all' cannot be found."):
        scheduler.unload_lora("all")
    scheduler.load_lora("qv", adapters["qv"])  # loaded with the one slot taken: it waits for the slot
    scheduler.add_request(3, PROMPT, replace(GREEDY, lora="qv"), seed=3)
    for out in scheduler.step():
        tokens.setdefault(out.rid, []).extend(out.token_ids)
    assert 3 not in scheduler.running and engine.loras.holders[1].name == "all"
    run_until_done(scheduler, tokens, cached)
    assert tokens[1] == peft_greedy(qwen3_dir, adapters["all"], PROMPT, 8)[0], "the unload did not touch it"
    assert tokens[3] == peft_greedy(qwen3_dir, adapters["qv"], PROMPT, 8)[0]
    # the slot was zeroed before "qv" was copied in: no layer keeps the first adapter's weights
    assert engine.loras.holders[1] is engine.loras.loaded["qv"] and not engine.loras.unloaded_slots()
    layers = engine.lora_layers.values()
    assert all(float(layer.lora.a[1].abs().sum()) == 0 for layer in layers if 1 not in layer.lora.filled)
    assert {name.rpartition(".")[2] for name, layer in engine.lora_layers.items() if 1 in layer.lora.filled} \
        == {"qkv_proj"}

    # "qv" unloaded and loaded again (the same name and files): a new load shares no cached pages with the old
    scheduler.unload_lora("qv")
    scheduler.load_lora("qv", adapters["qv"])
    for rid in (4, 5):
        scheduler.add_request(rid, PROMPT, replace(GREEDY, lora="qv"), seed=rid)
        run_until_done(scheduler, tokens, cached)
    assert cached[4] == 0 and cached[5] > 0, cached
    assert tokens[4] == tokens[5] == tokens[3]



def test_a_load_one_rank_fails_is_undone_on_every_rank(qwen3_dir, adapters, monkeypatch):
    """Each rank reads the adapter's files itself (another node's copy may be missing or damaged): a load that
    fails on any rank is refused and undone on the ranks that did it, or their books (and batches) would differ."""
    from tpserve.message import LoadLoRA
    from tpserve.scheduler import process
    from tpserve.scheduler.io import LocalIO

    engine = Engine(EngineConfig(model=qwen3_dir, device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8))
    loop = process.SchedulerLoop(Scheduler(engine), LocalIO(), check_ranks=False)
    monkeypatch.setattr(process, "every_rank", lambda value, group: [value, "No adapter found for /a on node 1"])
    loop.apply(LoadLoRA(7, "qv", adapters["qv"]))
    answer = loop.io.outbox.pop().lora
    assert answer.rid == 7 and answer.error == "tp rank 1: No adapter found for /a on node 1"
    assert not engine.loras.loaded and not engine.loras.holders, "undone on the rank that loaded it"
    monkeypatch.setattr(process, "every_rank", lambda value, group: [value, None])
    loop.apply(LoadLoRA(8, "qv", adapters["qv"]))
    assert loop.io.outbox.pop().lora.error is None and "qv" in engine.loras.loaded


def test_more_adapters_than_slots_take_turns(qwen3_dir, adapters, tmp_path):
    """Three adapters, two slots, requests of each and of the base model queued at once: every step's batch uses at
    most two adapters, a request whose adapter finds no slot lets the ones behind it in (the base model's at once),
    the least recently used idle slot is taken, and every request gets PEFT's (or the base model's) tokens."""
    from lora_adapters import make_adapter, peft_greedy
    from reference import hf_greedy

    third = make_adapter(qwen3_dir, str(tmp_path / "od"), ("o_proj", "down_proj"), rank=2, seed=5)
    engine = Engine(EngineConfig(model=qwen3_dir, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8))
    scheduler = Scheduler(engine)
    scheduler.check_accounting = True  # a running request's slot never changes hands
    paths = {**adapters, "od": third}
    for name, path in paths.items():
        scheduler.load_lora(name, path)
    which = {1: "all", 2: "qv", 3: "od", 4: None, 5: "all", 6: "od", 7: "qv"}
    for rid, name in which.items():
        scheduler.add_request(rid, PROMPT[: 10 + rid], replace(GREEDY, lora=name), seed=rid)
    tokens: dict[int, list[int]] = {}
    first_step: dict[int, int] = {}
    while scheduler.has_work:
        for out in scheduler.step():
            tokens.setdefault(out.rid, []).extend(out.token_ids)
        for rid in scheduler.running:
            first_step.setdefault(rid, scheduler.step_count)
        in_use = {req.adapter.name for req in scheduler.running.values() if req.adapter is not None}
        assert len(in_use) <= 2, in_use
        if scheduler.step_count == 1:  # what /metrics' vllm:lora_requests_info shows
            stats = scheduler.stats()
            assert (stats.running_loras, stats.waiting_loras) == (["all", "qv"], ["od"]), stats
    assert first_step[4] == first_step[1] == first_step[2] == first_step[5] == first_step[7] == 1, first_step
    assert first_step[3] > 1 and first_step[6] > 1, "od waited for a slot"
    for rid, name in which.items():
        prompt = PROMPT[: 10 + rid]
        expected = (hf_greedy(qwen3_dir, prompt, 8) if name is None
                    else peft_greedy(qwen3_dir, paths[name], prompt, 8)[0])
        assert tokens[rid] == expected, (rid, name)


def test_an_adapter_for_another_shape_is_refused_at_load_not_at_admission(qwen3_dir, adapters, tmp_path):
    """An adapter whose tensors do not fit the model's layers (another model's hidden size) is refused when loaded,
    as before the adapters were kept in host memory: copied into a slot at a request's admission, it raised in the
    middle of a step (the scheduler, and every request, gone)."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "wider"
    shutil.copytree(adapters["all"], bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    name = next(n for n in tensors if n.endswith("q_proj.lora_A.weight"))
    tensors[name] = torch.cat([tensors[name], tensors[name][:, :8]], dim=1)  # 8 more input features
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    engine = Engine(EngineConfig(model=qwen3_dir, device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8))
    scheduler = Scheduler(engine)
    with pytest.raises(ValueError, match=r"LoRA adapter tensor .*q_proj.lora_A.weight has shape"):
        scheduler.load_lora("wider", str(bad))
    assert not engine.loras.loaded
