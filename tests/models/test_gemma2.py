"""Gemma 2 (Gemma2ForCausalLM, config model_type gemma2): Gemma 3's decoder layer ((1 + weight) RMSNorms folded into
the weights at load, sandwich norms, GELU (tanh) MLP, embedding times sqrt(hidden_size), softmax scale
query_pre_attn_scalar ** -0.5) without q/k norms or a local rotary, its sliding_attention layers within the window,
and the logit soft-caps: attention scores capped (cap * tanh(score / cap)) before the mask and softmax by every
attention backend, the LM head's logits after the vocabulary all-gather. test_vs_transformers checks the tiny model's
logits and tokens against transformers' eager attention at TP 1 and 2. Here: transformers' reference is the eager
attention and each Gemma 2 setting changes its answer (so those checks cannot pass with one ignored), the published
config.json read as transformers reads it, what is refused, and Gemma 3's final soft-cap (transformers applies it; the
attention one it ignores, so tpserve refuses it: test_gemma3)."""

from __future__ import annotations


import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config

from model_dirs import config_of, with_config
from reference import hf_logits, hf_model
from test_vs_transformers import teacher_forced_logits
from tpserve.config import ModelConfig
from tpserve.engine.engine import Engine
from tpserve.engine_config import EngineConfig

GEMMA2 = {"head_dim": 32}  # as test_vs_transformers' tiny Gemma 2: 4 heads of 32 over hidden 64, 2 KV heads, untied
GEMMA3 = {"num_kv_heads": 1, "head_dim": 32, "tie_word_embeddings": True}  # as test_gemma3's
IDS = list(range(30, 70))

# google/gemma-2-2b-it's config.json (transformers 4.42's layout: rope_theta, no layer_types: the even layers local)
GEMMA2_2B_IT = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
    "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32", "transformers_version": "4.42.4",
    "use_cache": True, "vocab_size": 256000,
}


@pytest.fixture(scope="module")
def gemma2_dir(tiny_model_factory):
    return tiny_model_factory("gemma2", **GEMMA2)


def test_the_reference_is_transformers_eager_attention_with_every_tensor(gemma2_dir, monkeypatch):
    """transformers' SDPA path has no soft-cap: the reference must be its eager attention, which caps, even were
    transformers' Gemma 2 to take SDPA by default (it declares no SDPA support today)."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2PreTrainedModel

    assert hf_model(gemma2_dir).config._attn_implementation == "eager"
    monkeypatch.setattr(Gemma2PreTrainedModel, "_supports_sdpa", True)
    assert hf_model.__wrapped__(gemma2_dir).config._attn_implementation == "eager"  # (not the cached model)
    _, info = AutoModelForCausalLM.from_pretrained(gemma2_dir, output_loading_info=True)
    assert not any(info.values()), f"the tiny checkpoint does not fit transformers' Gemma 2: {info}"


@pytest.mark.parametrize("change", ["attn_logit_softcapping", "final_logit_softcapping", "sliding_window",
                                    "query_pre_attn_scalar"])
def test_each_gemma2_setting_changes_the_logits(gemma2_dir, tmp_path, change):
    """Each soft-cap removed, the window widened past the sequence, the softmax scale set to head_dim's: transformers'
    logits move."""
    config = config_of(gemma2_dir)
    value = {"attn_logit_softcapping": None, "final_logit_softcapping": None, "sliding_window": len(IDS),
             "query_pre_attn_scalar": config["head_dim"]}[change]
    changed = with_config(gemma2_dir, tmp_path, **{change: value})
    assert not torch.allclose(hf_logits(gemma2_dir, IDS), hf_logits(changed, IDS), atol=1e-2)


def test_the_published_config_is_read_as_transformers_reads_it():
    """gemma-2-2b-it: local layers (a window of 4,096 tokens) and global ones in turn, one rotary, attention scores
    capped at 50 and logits at 30; no q/k norms."""
    config = ModelConfig.from_dict(GEMMA2_2B_IT)
    hf = Gemma2Config.from_dict(GEMMA2_2B_IT)
    assert config.window_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")
    assert config.window_layers == tuple(range(0, 26, 2)) and config.sliding_window == 4096
    assert config.layer_windows == (4096, 0) * 13
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0} == hf.rope_parameters
    assert config.local_rope_parameters is None and config.local_layers == () and not config.qk_norm
    assert config.attn_logit_softcapping == 50.0 and config.final_logit_softcapping == 30.0
    assert config.attention_scale == 256**-0.5 and config.head_dim == 256 and config.num_key_value_heads == 4
    assert config.embedding_multiplier == 2304**0.5 and config.tie_word_embeddings
    assert config.hidden_act == "gelu_tanh" and config.norm_weight_offset == 1.0 and config.sandwich_norms
    assert config.context_length == 8192 and config.eos_token_ids == (1, 107)
    config.check_tp_size(4)
    # keys left out take transformers' defaults: Gemma 2's caps
    bare = {k: v for k, v in GEMMA2_2B_IT.items() if k not in ("attn_logit_softcapping", "final_logit_softcapping")}
    defaults = ModelConfig.from_dict(bare)
    assert (defaults.attn_logit_softcapping, defaults.final_logit_softcapping) == (50.0, 30.0)
    uncapped = ModelConfig.from_dict({**GEMMA2_2B_IT, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (uncapped.attn_logit_softcapping, uncapped.final_logit_softcapping) == (None, None)


@pytest.mark.parametrize("changes,message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type 'dynamic' is not supported"),
    ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping must be a positive number or null, got 0.0"),
    ({"final_logit_softcapping": -30.0}, "final_logit_softcapping must be a positive number or null, got -30.0"),
    ({"final_logit_softcapping": "30"}, "cannot be read as a gemma2 config.*final_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention true is not supported"),
    ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 13}, "layer_types must list 26 of"),
    ({"sliding_window": None}, "sliding_window is null, yet layer_types makes layers .0, 2, .* sliding_attention"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number, got 0"),
    ({"attention_bias": True}, "attention_bias true"),
])
def test_what_is_not_implemented_is_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**GEMMA2_2B_IT, **changes})


def test_gemma3_with_a_final_soft_cap_matches_transformers(tiny_model_factory, tmp_path):
    """transformers' Gemma 3 caps its logits where final_logit_softcapping is set (its published configs leave it
    null), so tpserve serves it there too."""
    plain = tiny_model_factory("gemma3_text", **GEMMA3)
    capped = with_config(plain, tmp_path, final_logit_softcapping=5.0)
    reference = hf_logits(capped, IDS)
    assert not torch.allclose(reference, hf_logits(plain, IDS), atol=1e-2)
    engine = Engine(EngineConfig(model=capped, device="cpu", page_size=4))
    ours = teacher_forced_logits(engine, IDS, prefill=9)
    engine.shutdown()
    err = (ours - reference[8 : len(IDS) - 1]).abs().max().item()
    print(f"gemma3_text, final_logit_softcapping 5: max logit error {err:.2e}")
    assert err < 1e-4, err
