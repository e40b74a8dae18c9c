"""LoRA adapters on a GPU (CPU correctness: tests/test_llm_lora.py): float32 greedy tokens equal PEFT's; in bf16,
where decode batches run the CUDA GEMVs with fused norms and CUDA graphs, a batch holding an adapter runs eagerly
with those fusions bypassed in the adapted layers, its logits near PEFT's, and the base model's requests beside it
keep their answers."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from lora_adapters import make_adapter, peft_greedy
from tpserve import LLM, LoRARequest, SamplingParams

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 137))]


@pytest.fixture(scope="module")
def model_and_adapter(tiny_model_factory, tmp_path_factory):
    model_dir = tiny_model_factory("qwen3", head_dim=128, hidden_size=256)
    return model_dir, make_adapter(model_dir, str(tmp_path_factory.mktemp("lora")), ALL)


def test_float32_adapter_matches_peft_on_cuda(model_and_adapter):
    model_dir, adapter = model_and_adapter
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(model_dir, device="cuda", dtype="float32", lora_modules={"a": adapter}) as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False, lora_request=[LoRARequest("a"), None, LoRARequest("a")])
    assert outs[0].token_ids == peft_greedy(model_dir, adapter, PROMPTS[0], 10)[0]
    assert outs[2].token_ids == peft_greedy(model_dir, adapter, PROMPTS[2], 10)[0]


@pytest.mark.parametrize("batch", [1, 3])
def test_bf16_adapter_batches_run_eagerly_near_peft(model_and_adapter, batch):
    model_dir, adapter = model_and_adapter
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompts = PROMPTS[:batch]
    with LLM(model_dir, device="cuda", dtype="bfloat16", lora_modules={"a": adapter}) as llm:
        base = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        mixed = llm.generate(prompts, params, use_tqdm=False, lora_request=[LoRARequest("a")] + [None] * (batch - 1))
    assert [o.token_ids for o in mixed[1:]] == base[1:], "the base model's requests beside an adapter's"
    expected, logits = peft_greedy(model_dir, adapter, prompts[0], 6)
    reference = torch.log_softmax(logits, dim=-1)
    first = mixed[0]
    assert first.token_ids[0] == expected[0] and first.token_ids != base[0]
    worst = max(abs(v - float(reference[0, t])) for t, v in zip(first.token_ids[:1], first.token_logprobs[:1]))
    assert worst < 5e-2, worst
