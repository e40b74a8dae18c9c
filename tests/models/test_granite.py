"""Granite (GraniteForCausalLM): Llama's decoder with four scalars (``config.GRANITE_SCALARS``). The tiny model carries
Granite 3's values; test_vs_transformers checks it against transformers at TP 1 and 2. Here: each scalar changes the
answer (so those checks cannot pass with one ignored), and the paths that fold the residual multiplier into weights
(FP8 scales, LoRA adapters) against their references."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from fp8_checkpoint import write_dequantized, write_fp8_checkpoint
from reference import hf_greedy, hf_logits
from test_vs_transformers import PROMPTS
from tpserve import LLM, LoRARequest, SamplingParams
from tpserve.config import ModelConfig
from tpserve.tiny.config import GRANITE_SCALARS

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def granite_dir(tiny_model_factory):
    return tiny_model_factory("granite", tie_word_embeddings=True)


@pytest.mark.parametrize("scalar", sorted(GRANITE_SCALARS))
def test_each_scalar_changes_the_logits(granite_dir, tmp_path, scalar):
    """The same weights with one scalar at 1: transformers' logits move (logits_scaling keeps their argmax)."""
    shutil.copytree(granite_dir, tmp_path, dirs_exist_ok=True)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**config, scalar: 1.0}, f)
    ids = list(range(30, 50))
    assert not torch.allclose(hf_logits(granite_dir, ids), hf_logits(str(tmp_path), ids), atol=1e-2)


def test_fp8_checkpoint_folds_the_residual_multiplier_into_its_scales(granite_dir, tmp_path):
    """o_proj's and down_proj's FP8 weights keep their bits; their block scales take the multiplier."""
    fp8_dir = write_fp8_checkpoint(granite_dir, str(tmp_path / "fp8"), (16, 16), ("lm_head",))
    ref_dir = write_dequantized(fp8_dir, str(tmp_path / "ref"))
    expected = [hf_greedy(ref_dir, p, 12) for p in PROMPTS]
    for tp in (1, 2):
        with LLM(fp8_dir, tp_size=tp, device="cpu", page_size=4) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected, f"tp {tp}"


def test_lora_adapters_of_the_output_projections_take_the_multiplier(tiny_model_factory, tmp_path):
    """An adapter's o_proj and down_proj outputs join the residual times residual_multiplier, as PEFT's model."""
    from lora_adapters import make_adapter, peft_greedy

    granite_dir = tiny_model_factory("granite")  # untied: the tied tiny model repeats its last token, adapter or not

    adapter = make_adapter(granite_dir, str(tmp_path / "lora"), ("o_proj", "down_proj", "q_proj"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompt = PROMPTS[2]
    with LLM(granite_dir, device="cpu", lora_modules={"a": adapter}) as llm:
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("a"))[0]
    expected, logits = peft_greedy(granite_dir, adapter, prompt, 8)
    assert out.token_ids == expected and out.token_ids != hf_greedy(granite_dir, prompt, 8)
    reference = torch.log_softmax(logits, dim=-1)
    worst = max(abs(v - float(reference[i, t])) for i, (t, v) in enumerate(zip(out.token_ids, out.token_logprobs)))
    assert worst < 1e-4, worst


@pytest.mark.parametrize("value", [0, "12", None, float("inf")])
def test_a_bad_scalar_is_an_error_naming_it(granite_dir, value):
    with open(os.path.join(granite_dir, "config.json")) as f:
        config = json.load(f)
    with pytest.raises(ValueError, match="residual_multiplier"):
        ModelConfig.from_dict({**config, "residual_multiplier": value})
