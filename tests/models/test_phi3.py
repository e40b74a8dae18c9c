"""Phi-3 (Phi3ForCausalLM: Phi-3, Phi-3.5-MoE aside, Phi-4): Llama's decoder whose checkpoints fuse q/k/v into one
``qkv_proj`` and gate/up into one ``gate_up_proj``; the loader splits them into the parts it shards
(test_vs_transformers checks the tokens at TP 1 and 2). Here: what a checkpoint that does not fit says, and the
sliding window Phi-3-mini's config carries (test_vs_transformers, at TP 2: its tokens)."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file, save_file

from tpserve import LLM
from tpserve.config import ModelConfig


@pytest.fixture(scope="module")
def phi3_dir(tiny_model_factory):
    return tiny_model_factory("phi3")


def rewrite(model_dir: str, out, edit) -> str:
    """A copy of ``model_dir`` in ``out`` with its weights passed through ``edit``."""
    import shutil

    shutil.copytree(model_dir, out)
    weights = load_file(os.path.join(out, "model.safetensors"))
    save_file(edit(weights), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def test_a_fused_tensor_of_other_rows_names_its_parts(phi3_dir, tmp_path):
    name = "model.layers.0.self_attn.qkv_proj.weight"
    bad = rewrite(phi3_dir, tmp_path / "bad", lambda w: {**w, name: w[name][:-2]})
    with pytest.raises(ValueError, match=rf"{name}.*rows, not the .* of its fused parts"):
        LLM(bad, device="cpu")


def test_a_missing_fused_tensor_is_named_as_the_checkpoint_spells_it(phi3_dir, tmp_path):
    name = "model.layers.1.mlp.gate_up_proj.weight"
    bad = rewrite(phi3_dir, tmp_path / "missing", lambda w: {k: v for k, v in w.items() if k != name})
    with pytest.raises(ValueError, match=rf"weights missing from the checkpoint: {name}$"):
        LLM(bad, device="cpu")


def test_phi3_minis_sliding_window_applies_to_every_layer(phi3_dir):
    """transformers' Phi-3 applies sliding_window to every layer (Phi-3-mini-4k's 2047)."""
    with open(os.path.join(phi3_dir, "config.json")) as f:
        config = json.load(f)
    assert ModelConfig.from_dict(config).layer_windows == (0, 0)
    windowed = ModelConfig.from_dict({**config, "sliding_window": 2047})
    assert windowed.layer_windows == (2047, 2047) and windowed.context_length == config["max_position_embeddings"]


def test_partial_rotary_and_longrope_are_refused(phi3_dir):
    """Phi-4-mini's partial rotary and Phi-3.5's longrope scaling are not implemented: errors naming them."""
    with open(os.path.join(phi3_dir, "config.json")) as f:
        config = json.load(f)
    legacy = {k: v for k, v in config.items() if k != "rope_parameters"} | {"rope_theta": 10000.0}
    for partial in ({**config, "rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": 0.75}},
                    {**legacy, "partial_rotary_factor": 0.75}):  # as transformers 5 saves it, and Phi-4-mini's
        with pytest.raises(ValueError, match="partial_rotary_factor 0.75"):
            ModelConfig.from_dict(partial)
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                "original_max_position_embeddings": 1024}
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_dict({**config, "rope_parameters": longrope})


@pytest.mark.parametrize("tp", [1, 2])
def test_a_peft_adapter_of_the_fused_projections_matches_peft(phi3_dir, tmp_path, tp):
    """A Phi-3 PEFT adapter names the checkpoint's fused qkv_proj and gate_up_proj ("all-linear" adapts them): one A,
    B over all the parts' rows; served as each part's (it was refused: 'adapts gate_up_proj, qkv_proj'). PEFT's tokens
    at TP 1 and 2, and a B of other rows is an error naming them."""
    from lora_adapters import make_adapter, peft_greedy
    from tpserve import SamplingParams
    from tpserve.inputs import LoRARequest

    adapter = make_adapter(phi3_dir, str(tmp_path / "all"), "all-linear", rank=4)
    prompt = [5, 6, 7, 8, 9]
    with LLM(phi3_dir, device="cpu", tensor_parallel_size=tp, lora_modules={"a": adapter}, max_lora_rank=4) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                           lora_request=LoRARequest("a"))[0]
        base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == peft_greedy(phi3_dir, adapter, prompt, 8)[0] != base.token_ids
    if tp == 1:
        import shutil

        bad = tmp_path / "bad"
        shutil.copytree(adapter, bad)
        tensors = load_file(str(bad / "adapter_model.safetensors"))
        name = next(k for k in tensors if "qkv_proj.lora_B" in k)
        save_file({**tensors, name: tensors[name][:-2]}, str(bad / "adapter_model.safetensors"))
        with pytest.raises(Exception, match=r"rows should be the \d+ of the fused module's parts"):
            LLM(phi3_dir, device="cpu", lora_modules={"b": str(bad)}, max_lora_rank=4)
