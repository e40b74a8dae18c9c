"""Gemma 3 (Gemma3ForCausalLM, config model_type gemma3_text): the shared decoder with Gemma's RMSNorms (times 1 + weight,
folded into the weights at load), its sandwich norms, GELU (tanh) MLP, embedding times sqrt(hidden_size), softmax scale
query_pre_attn_scalar ** -0.5 and its local (sliding-window) layers' own rotary. test_vs_transformers checks the tiny
model's logits and tokens against transformers at TP 1 and 2 (one KV head, replicated at TP 2). Here: each Gemma setting
changes transformers' answer (so those checks cannot pass with one ignored), the published config.json read as
transformers reads it, what is refused, and the FP8 and LoRA paths."""

from __future__ import annotations

import json

import pytest
import torch

from model_dirs import config_of, with_config
from reference import hf_greedy, hf_logits
from test_vs_transformers import PROMPTS
from tpserve import LLM, LoRARequest, SamplingParams
from tpserve.config import ModelConfig

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
GEMMA3 = {"num_kv_heads": 1, "head_dim": 32, "tie_word_embeddings": True}  # as test_vs_transformers' tiny Gemma 3

# google/gemma-3-1b-it's config.json (transformers 4.50's layout: rope_theta, rope_local_base_freq, the pattern)
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 262144,
}


@pytest.fixture(scope="module")
def gemma3_dir(tiny_model_factory):
    return tiny_model_factory("gemma3_text", **GEMMA3)


@pytest.mark.parametrize("change", ["query_pre_attn_scalar", "local_rope_theta", "global_rope_scaling"])
def test_each_gemma_setting_changes_the_logits(gemma3_dir, tmp_path, change):
    """The softmax scale and the local layers' rotary (theta 10,000 where the global layers' is 1,000,000, which the
    linear scaling divides): each, changed, moves transformers' logits."""
    config = config_of(gemma3_dir)
    rope = json.loads(json.dumps(config["rope_parameters"]))
    if change == "query_pre_attn_scalar":
        changes = {"query_pre_attn_scalar": config["head_dim"]}
    elif change == "local_rope_theta":
        rope["sliding_attention"]["rope_theta"] = rope["full_attention"]["rope_theta"]
        changes = {"rope_parameters": rope}
    else:
        rope["full_attention"] = {"rope_type": "default", "rope_theta": rope["full_attention"]["rope_theta"]}
        changes = {"rope_parameters": rope}
    ids = list(range(30, 70))
    assert not torch.allclose(hf_logits(gemma3_dir, ids), hf_logits(with_config(gemma3_dir, tmp_path, **changes), ids),
                              atol=1e-2)


def test_the_published_config_is_read_as_transformers_reads_it():
    """gemma-3-1b-it: global layers every sixth (theta 1,000,000), the others local (theta 10,000, a window of 512
    tokens)."""
    config = ModelConfig.from_dict(GEMMA3_1B)
    assert config.local_layers == tuple(i for i in range(26) if (i + 1) % 6)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
    assert config.local_rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert config.attention_scale == 256**-0.5 and config.head_dim == 256 and config.num_key_value_heads == 1
    assert config.embedding_multiplier == 1152**0.5 and config.tie_word_embeddings
    assert config.hidden_act == "gelu_tanh" and config.norm_weight_offset == 1.0 and config.sandwich_norms
    assert config.context_length == 32768 and config.eos_token_ids == (1, 106)
    assert config.window_layers == config.local_layers and set(config.layer_windows) == {0, 512}
    config.check_tp_size(2)  # the one KV head replicated
    # the 4B+'s text config: linear scaling (factor 8) of the global layers only
    scaled = ModelConfig.from_dict({**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert scaled.rope_parameters == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
    assert scaled.local_rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


def test_a_linearly_scaled_gemma3_serves_its_max_position_embeddings():
    """Gemma 3 4B+'s text config: max_position_embeddings (131,072) is the scaled context already, linear factor 8 or
    not (vLLM does not multiply Gemma 3's by the factor). Before sliding windows the window (1,024) capped the context,
    which hid a 1,048,576-token context_length here."""
    text_4b = {**GEMMA3_1B, "max_position_embeddings": 131072, "sliding_window": 1024,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    config = ModelConfig.from_dict(text_4b)
    assert config.rope_parameters["factor"] == 8.0 and config.context_length == 131072


@pytest.mark.parametrize("changes,message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type 'dynamic' is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "longrope", "rope_theta": 1e6, "short_factor": [1.0] * 128,
                                             "long_factor": [1.0] * 128, "original_max_position_embeddings": 512},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters.full_attention.rope_type 'longrope' is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type 'dynamic' is not supported"),
    # transformers' Gemma 3 reads it but never applies it (its final_logit_softcapping it applies: test_gemma2)
    ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping is not supported \(transformers' Gemma 3 does not "
                                       r"apply it\)"),
    ({"final_logit_softcapping": 0.0}, "final_logit_softcapping must be a positive number or null, got 0.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention true is not supported"),
    ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
])
def test_what_is_not_implemented_is_refused_by_name(changes, message):
    legacy = {k: v for k, v in GEMMA3_1B.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    config = {**(GEMMA3_1B if "rope_parameters" not in changes else legacy), **changes}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(config)


def test_a_gelu_mixture_of_experts_is_refused(tiny_model_factory):
    """The expert kernels compute SiLU only."""
    config = config_of(tiny_model_factory("qwen3_moe", num_layers=3))
    with pytest.raises(ValueError, match="hidden_act 'gelu_pytorch_tanh' is not supported in a mixture-of-experts"):
        ModelConfig.from_dict({**config, "hidden_act": "gelu_pytorch_tanh"})


def test_the_embedding_multiplier_is_rounded_to_the_compute_dtype():
    """transformers casts Gemma's sqrt(hidden_size) to the weights' dtype: 33.94 is 34 in bfloat16."""
    from tpserve.models.decoder import embedding_multiplier

    config = ModelConfig.from_dict(GEMMA3_1B)
    assert embedding_multiplier(config, torch.bfloat16) == 34.0
    assert embedding_multiplier(config, torch.float32) == float(torch.tensor(1152**0.5, dtype=torch.float32))


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_checkpoint(gemma3_dir, tmp_path, tp):
    """An FP8 block-quantized Gemma 3 (the LM head, tied to the embedding, kept): the dequantized model's tokens."""
    from fp8_checkpoint import write_dequantized, write_fp8_checkpoint

    fp8_dir = write_fp8_checkpoint(gemma3_dir, str(tmp_path / "fp8"), (16, 16), ("lm_head",))
    ref_dir = write_dequantized(fp8_dir, str(tmp_path / "ref"))
    expected = [hf_greedy(ref_dir, p, 12) for p in PROMPTS]
    with LLM(fp8_dir, tp_size=tp, device="cpu", page_size=4) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


@pytest.mark.parametrize("tp", [1, 2])
def test_a_peft_adapter_matches_peft(gemma3_dir, tmp_path, tp):
    """An adapter of every projection (gate/up through the GELU path): PEFT's tokens and log-probabilities."""
    from lora_adapters import make_adapter, peft_greedy

    adapter = make_adapter(gemma3_dir, str(tmp_path / "lora"), "all-linear")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompt = PROMPTS[2]
    with LLM(gemma3_dir, device="cpu", tensor_parallel_size=tp, lora_modules={"a": adapter}) as llm:
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=LoRARequest("a"))[0]
    expected, logits = peft_greedy(gemma3_dir, adapter, prompt, 8)
    assert out.token_ids == expected and out.token_ids != hf_greedy(gemma3_dir, prompt, 8)
    reference = torch.log_softmax(logits, dim=-1)
    worst = max(abs(v - float(reference[i, t])) for i, (t, v) in enumerate(zip(out.token_ids, out.token_logprobs)))
    print(f"tp {tp}: max log-probability error {worst:.2e}")
    assert worst < 1e-4, worst


def test_the_gelu_mlp_never_takes_a_silu_path(gemma3_dir, monkeypatch):
    """The merged gate/up layer's silu_and_mul (the GEMV's SiLU epilogue on a GPU, FlashInfer's kernel) is never
    called: the GELU model's tokens come without it (tests/gpu/test_gemma3_gpu.py runs the same spy on CUDA)."""
    from tpserve.layers.linear import MergedColumnParallelLinear

    def refuse(*args, **kwargs):
        raise AssertionError("a GELU model took a SiLU path")

    monkeypatch.setattr(MergedColumnParallelLinear, "silu_and_mul", refuse)
    with LLM(gemma3_dir, device="cpu", page_size=4) as llm:
        assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].token_ids == hf_greedy(gemma3_dir, PROMPTS[0], 12)
