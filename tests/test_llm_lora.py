"""LoRA adapters (``models/adapters.py``) against PEFT's own model (float32, CPU): greedy tokens equal and
log-probabilities within 1e-4, at TP 1 and 2, with several adapters and the base model in one batch."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tpserve import LLM, LoRARequest, SamplingParams

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(qwen3_dir, tmp_path_factory):
    from lora_adapters import make_adapter

    return {"all": make_adapter(qwen3_dir, str(tmp_path_factory.mktemp("lora-all")), ALL),
            "qv": make_adapter(qwen3_dir, str(tmp_path_factory.mktemp("lora-qv")), ("q_proj", "v_proj"), rank=8,
                               alpha=4, seed=1, rslora=True)}


@pytest.mark.parametrize("tp", [1, 2])
def test_adapters_match_peft_in_one_batch(qwen3_dir, adapters, tp):
    from lora_adapters import peft_greedy
    from reference import hf_greedy

    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [5, 6, 7, 8, 9]]
    which = ["all", "qv", None]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    with LLM(qwen3_dir, device="cpu", tensor_parallel_size=tp, lora_modules=adapters, max_lora_rank=8,
             enable_lora=True, max_loras=2) as llm:
        requests = [None if name is None else LoRARequest(name, i + 1, adapters[name]) for i, name in enumerate(which)]
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    worst = 0.0
    for prompt, name, out in zip(prompts, which, outs):
        if name is None:
            assert out.token_ids == hf_greedy(qwen3_dir, prompt, 8)
            continue
        expected, logits = peft_greedy(qwen3_dir, adapters[name], prompt, 8)
        assert out.token_ids == expected, name
        reference = torch.log_softmax(logits, dim=-1)
        worst = max(worst, max(abs(v - float(reference[i, t])) for i, (t, v) in
                               enumerate(zip(out.token_ids, out.token_logprobs))))
    assert outs[0].token_ids != outs[2].token_ids, "the adapter changes the answer"
    assert worst < 1e-4, worst


def test_adapters_keep_their_own_cached_prefixes(qwen3_dir, adapters):
    """A prompt's cached pages serve only requests of the same adapter (an adapter changes every layer's K and V);
    an adapter the LLM was not started with, or too large a rank, is a ValueError."""
    prompt = list(range(10, 50))  # 40 tokens: two whole pages of 16
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with LLM(qwen3_dir, device="cpu", lora_modules={"all": adapters["all"]}) as llm:
        cached = []
        for adapter in (None, None, LoRARequest("all"), LoRARequest("all"), None):
            cached.append(llm.generate([prompt], params, use_tqdm=False, lora_request=adapter)[0].num_cached_tokens)
        assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0 and cached[3] > 0 and cached[4] > 0, cached
        with pytest.raises(ValueError, match="LoRA adapter 'qv' is not loaded"):
            llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("qv", 2, adapters["qv"]))
    with pytest.raises(ValueError, match="has rank 8, more than --max-lora-rank 4"):
        LLM(qwen3_dir, device="cpu", lora_modules={"qv": adapters["qv"]}, max_lora_rank=4)


def test_adapters_tpserve_cannot_serve_are_clear_errors(qwen3_dir, adapters, tmp_path):
    import shutil

    from tpserve.models.adapters import read_adapter_config

    bad = tmp_path / "bad"
    shutil.copytree(adapters["all"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    for change, message in (({"target_modules": ["embed_tokens"]}, "adapts embed_tokens: tpserve adapts only"),
                            ({"use_dora": True}, "use_dora is not served"), ({"r": 0}, "r must be a positive")):
        (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            read_adapter_config(str(bad), 16)
    os.remove(bad / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="needs adapter_config.json and adapter_model.safetensors"):
        read_adapter_config(str(bad), 16)


def test_a_moe_models_attention_adapter_matches_peft_and_expert_adapters_are_refused(tiny_model_factory, tmp_path):
    """Qwen3-MoE (one dense layer, mlp_only_layers): an adapter of its attention and its dense layer's MLP is served
    (PEFT's tokens); one of the experts' projections is an error naming them, not a silent no-op."""
    from lora_adapters import make_adapter, peft_greedy

    moe_dir = tiny_model_factory("qwen3_moe")
    adapter = make_adapter(moe_dir, str(tmp_path / "attn"), ("q_proj", "k_proj", "v_proj", "o_proj"))
    prompt = [5, 6, 7, 8, 9]
    with LLM(moe_dir, device="cpu", lora_modules={"a": adapter}) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False,
                           lora_request=LoRARequest("a"))[0]
    assert out.token_ids == peft_greedy(moe_dir, adapter, prompt, 6)[0]
    experts = tmp_path / "experts"
    experts.mkdir()
    from safetensors.torch import save_file

    config = json.loads((tmp_path / "attn" / "adapter_config.json").read_text())
    (experts / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["gate_proj"]}))
    save_file({"base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight": torch.zeros(4, 64),
               "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_B.weight": torch.zeros(32, 4)},
              str(experts / "adapter_model.safetensors"))
    with pytest.raises(Exception, match="adapts a layer this model does not have"):
        LLM(moe_dir, device="cpu", lora_modules={"e": str(experts)})


def test_beam_search_runs_with_the_adapter(qwen3_dir, adapters):
    """LLM.beam_search(..., lora_request=...) searches the adapted model: PEFT's own num_beams search."""
    from tpserve import BeamSearchParams

    from lora_adapters import peft_model

    prompt = [5, 6, 7, 8]
    with LLM(qwen3_dir, device="cpu", lora_modules={"all": adapters["all"]}) as llm:
        beams = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=4,
                                ignore_eos=True, length_penalty=0.0), lora_request=LoRARequest("all"))[0].sequences
    with torch.inference_mode():
        out = peft_model(qwen3_dir, adapters["all"]).generate(
            input_ids=torch.tensor([prompt]), num_beams=2, num_return_sequences=2, max_new_tokens=4, min_new_tokens=4,
            do_sample=False, length_penalty=0.0, early_stopping=False)
    assert [b.tokens[len(prompt):] for b in beams] == [seq[len(prompt):].tolist() for seq in out]


def test_target_modules_as_peft_writes_them_and_bf16_adapters_match_peft(qwen3_dir, tmp_path):
    """PEFT saves target_modules as a regex string as given, and "all-linear" as full module paths: the adapted layers
    are the tensors' (as vLLM reads them). A bf16 adapter of a float32 model is scaled in float32 (rsLoRA's
    alpha / sqrt(r) is no power of two): PEFT's logits within 1e-4."""
    from lora_adapters import make_adapter, peft_greedy

    regex = make_adapter(qwen3_dir, str(tmp_path / "regex"), r".*\.(q_proj|down_proj)", rank=3, alpha=7, rslora=True,
                         dtype=torch.bfloat16)
    linear = make_adapter(qwen3_dir, str(tmp_path / "all-linear"), "all-linear", seed=2)
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    with LLM(qwen3_dir, device="cpu", lora_modules={"regex": regex, "linear": linear}) as llm:
        outs = llm.generate([prompt, prompt], params, use_tqdm=False,
                            lora_request=[LoRARequest("regex"), LoRARequest("linear")])
    for adapter, out in zip((regex, linear), outs):
        expected, logits = peft_greedy(qwen3_dir, adapter, prompt, 6)
        assert out.token_ids == expected, adapter
        reference = torch.log_softmax(logits, dim=-1)
        worst = max(abs(v - float(reference[i, t])) for i, (t, v) in enumerate(zip(out.token_ids, out.token_logprobs)))
        assert worst < 1e-4, (adapter, worst)


def test_chat_and_beam_search_take_a_lora_request(qwen3_dir, adapters):
    """As vLLM's LLM.chat(lora_request=...) and LLM.beam_search(prompts, params, lora_request): the adapter's answer
    (a one-beam search is its greedy answer), the base model's where a prompt's request is None."""
    from tpserve import BeamSearchParams

    prompt = [5, 6, 7, 8, 9]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    messages = [{"role": "user", "content": "Tell me about the clockmaker"}]
    with LLM(qwen3_dir, device="cpu", lora_modules={"all": adapters["all"]}) as llm:
        adapted, base = (llm.generate([prompt], greedy, use_tqdm=False, lora_request=r)[0].outputs[0].token_ids
                         for r in (LoRARequest("all"), None))
        beams = llm.beam_search([{"prompt_token_ids": prompt}] * 2, BeamSearchParams(beam_width=1, max_tokens=5,
                                ignore_eos=True), [LoRARequest("all"), None])
        chats = [llm.chat(messages, greedy, use_tqdm=False, lora_request=r)[0].outputs[0].token_ids
                 for r in (LoRARequest("all"), None)]
    assert adapted != base
    assert [out.sequences[0].tokens[len(prompt):] for out in beams] == [adapted, base]
    assert chats[0] != chats[1]


@pytest.mark.parametrize("tp", [1, 2])
def test_adapters_loaded_at_run_time_match_peft(qwen3_dir, adapters, tp):
    """LLM.add_lora of two adapters with the one slot of max_loras=1 (vLLM's default): their requests, queued at once
    with the base model's, take turns in the slot (every rank swapping at the same step), each with PEFT's greedy
    tokens and log-probabilities (the one adapting fewer layers with no trace of the other); after remove_lora
    the adapter is unknown and the other still served."""
    from lora_adapters import peft_greedy
    from reference import hf_greedy

    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    with LLM(qwen3_dir, device="cpu", tensor_parallel_size=tp, enable_lora=True, max_lora_rank=8) as llm:
        assert llm.add_lora(LoRARequest("all", 1, adapters["all"]))
        assert llm.add_lora(LoRARequest("qv", 2, adapters["qv"])) and llm.list_loras() == ["all", "qv"]
        which = ["all", None, "qv", "all", "qv"]
        outs = llm.generate([prompt] * len(which), params, use_tqdm=False,
                            lora_request=[name and LoRARequest(name) for name in which])
        assert llm.remove_lora("all") and not llm.remove_lora("all")
        with pytest.raises(ValueError, match="LoRA adapter 'all' is not loaded"):
            llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("all"))
        outs += llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("qv"))
    assert outs[1].outputs[0].token_ids == hf_greedy(qwen3_dir, prompt, 8)
    for name, out in zip([*which, "qv"], outs):
        if name is None:
            continue
        expected, logits = peft_greedy(qwen3_dir, adapters[name], prompt, 8)
        assert out.outputs[0].token_ids == expected, name
        reference = torch.log_softmax(logits, dim=-1)
        worst = max(abs(v - float(reference[i, t])) for i, (t, v) in enumerate(zip(expected, out.token_logprobs)))
        assert worst < 1e-4, (name, worst)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids, "the adapter changes the answer"


def test_a_run_time_adapter_reaches_every_replica(qwen3_dir, adapters):
    """dp_size=2: add_lora loads it into each replica (each answers), so requests routed to either run with it."""
    from lora_adapters import peft_greedy

    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [7, 8], [60, 61, 62, 63]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(qwen3_dir, device="cpu", dp_size=2, enable_lora=True, load_balance_method="minimum_tokens") as llm:
        llm.add_lora(LoRARequest("all", 1, adapters["all"]))
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("all"))
        assert all(stats.prompt_tokens_total > 0 for stats in llm.replica_stats()), "both replicas served"
        assert llm.remove_lora("all") and llm.list_loras() == []
    assert [out.outputs[0].token_ids for out in outs] == [peft_greedy(qwen3_dir, adapters["all"], p, 4)[0]
                                                          for p in prompts]


def test_a_lora_request_with_a_path_is_loaded_on_first_use(qwen3_dir, adapters):
    """vLLM's offline LoRA: LLM(enable_lora=True).generate(..., lora_request=LoRARequest(name, id, path)) loads the
    adapter the first time it is named (no add_lora call), then serves it as PEFT's; without enable_lora it is the
    not-loaded ValueError."""
    from lora_adapters import peft_greedy

    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(qwen3_dir, device="cpu", enable_lora=True, max_lora_rank=8) as llm:
        first = llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("all", 1, adapters["all"]))
        again = llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("all", 1, adapters["all"]))
        assert llm.list_loras() == ["all"]
    expected = peft_greedy(qwen3_dir, adapters["all"], prompt, 8)[0]
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids == expected
    with LLM(qwen3_dir, device="cpu") as llm:
        with pytest.raises(ValueError, match="LoRA adapter 'all' is not loaded"):
            llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("all", 1, adapters["all"]))


def test_add_lora_and_a_first_use_from_two_threads_load_the_adapter_once(qwen3_dir, adapters, monkeypatch):
    """A thread's add_lora and another's generate naming the same new adapter with its path: one load, and neither
    call fails (the generate's first-use load was the engine's 'already been loaded' ValueError while add_lora read
    the adapter's files)."""
    import threading
    import time

    import tpserve.llm_lora as llm_lora

    read = llm_lora.read_adapter_config

    def slow_read(path, max_rank):  # add_lora's file check takes a while (a large adapter, a slow disk)
        time.sleep(0.5)
        return read(path, max_rank)

    monkeypatch.setattr(llm_lora, "read_adapter_config", slow_read)
    request = LoRARequest("all", 1, adapters["all"])
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    errors: list[BaseException] = []

    def run(call) -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    with LLM(qwen3_dir, device="cpu", enable_lora=True, max_lora_rank=8) as llm:
        adding = threading.Thread(target=run, args=(lambda: llm.add_lora(request),))
        adding.start()
        time.sleep(0.1)
        run(lambda: llm.generate([[5, 6, 7]], params, use_tqdm=False, lora_request=request))
        adding.join()
        assert llm.list_loras() == ["all"]
    assert errors == [], errors


def test_an_adapter_whose_r_disagrees_with_its_tensors_names_the_tensor(qwen3_dir, adapters, tmp_path):
    """adapter_config.json's r must be its tensors' rank; it was torch's "size of tensor a ..." message."""
    import shutil

    bad = tmp_path / "bad-rank"
    shutil.copytree(adapters["all"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": config["r"] + 2}))
    with pytest.raises(ValueError, match=r"LoRA adapter tensor .*lora_A.weight has shape \(4, \d+\): its rows must be "
                                         r"the adapter's r \(6\)"):
        LLM(qwen3_dir, device="cpu", lora_modules={"bad": str(bad)})
