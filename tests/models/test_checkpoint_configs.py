"""Checkpoints as users save them: config.json in transformers 5's layout (``rope_parameters``)
and in the legacy one (``rope_theta`` + ``rope_scaling``), every rope type tpserve implements,
and models written by transformers' own ``save_pretrained``; greedy tokens and logits against
transformers at TP 1 and 2 (float32, CPU). Settings tpserve does not implement are errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from test_vs_transformers import PROMPTS, teacher_forced_logits
from transformers import AutoModelForCausalLM

from reference import hf_greedy, hf_logits
from tpserve import LLM, SamplingParams
from tpserve.config import ModelConfig, MoEConfig
from tpserve.engine_config import EngineConfig
from tpserve.engine.engine import Engine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LAYOUTS = ["transformers5", "legacy"]
ROPES = [("qwen3", "default"), ("llama", "llama3"), ("qwen3", "yarn"), ("mistral", "linear")]


def check_against_transformers(model_dir: str, label: str) -> None:
    engine = Engine(EngineConfig(model=model_dir, device="cpu", page_size=4))
    ids = list(range(30, 70))
    ours = teacher_forced_logits(engine, ids, prefill=9)
    ref = hf_logits(model_dir, ids)[8 : len(ids) - 1]
    err = (ours - ref).abs().max().item()
    print(f"{label}: max logit error {err:.2e}")
    assert err < 1e-4, f"{label}: max logit error {err}"
    engine.shutdown()
    with LLM(model_dir, device="cpu", page_size=4) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 12) for p in PROMPTS], label


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch,rope_type", ROPES)
def test_rope_types_in_both_layouts_match_transformers(tiny_model_factory, arch, rope_type, layout):
    model_dir = tiny_model_factory(arch, rope_type=rope_type, legacy_config=layout == "legacy")
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    assert ("rope_parameters" in cfg) is (layout == "transformers5")
    assert ModelConfig.from_pretrained(model_dir).rope_parameters["rope_type"] == rope_type
    check_against_transformers(model_dir, f"{arch} {rope_type} {layout}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch,rope_type", [r for r in ROPES if r[1] != "linear"])
def test_rope_types_in_both_layouts_at_tp2(tiny_model_factory, arch, rope_type, layout):
    model_dir = tiny_model_factory(arch, rope_type=rope_type, legacy_config=layout == "legacy")
    with LLM(model_dir, tp_size=2, device="cpu", page_size=8) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("arch,kwargs", [(arch, {}) for arch in ["qwen3", "qwen2", "llama", "mistral", "qwen3_moe",
                                                                   "qwen2_moe", "mixtral", "olmoe", "granite", "phi3",
                                                                   "gemma2", "gemma3_text"]]
                         # transformers writes a 0-wide shared expert's 0-row tensors and its gate; tpserve reads none
                         + [("qwen2_moe", {"shared_expert_intermediate_size": 0})], ids=str)
def test_models_saved_by_transformers(tiny_model_factory, tmp_path, arch, kwargs):
    """A checkpoint written by ``save_pretrained`` of the installed transformers, as a fine-tune is."""
    source = tiny_model_factory(arch, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(source, name), tmp_path / name)
    check_against_transformers(str(tmp_path), f"{arch} saved by transformers")


def test_scaled_rope_changes_the_tokens(tiny_model_factory):
    """Same weights, default vs YaRN rotary: a reader that dropped the scaling would be caught."""
    plain = tiny_model_factory("qwen3")
    yarn = tiny_model_factory("qwen3", rope_type="yarn")
    ids = list(range(30, 70))
    assert (hf_logits(plain, ids) - hf_logits(yarn, ids)).abs().max() > 0.5
    assert [hf_greedy(plain, p, 12) for p in PROMPTS] != [hf_greedy(yarn, p, 12) for p in PROMPTS]


def test_both_layouts_read_the_same(tiny_model_factory):
    for arch, rope_type in ROPES:
        new = ModelConfig.from_pretrained(tiny_model_factory(arch, rope_type=rope_type))
        old = ModelConfig.from_pretrained(tiny_model_factory(arch, rope_type=rope_type, legacy_config=True))
        assert new == old, (arch, rope_type)


def test_yarn_extends_the_context(tiny_model_factory):
    """Qwen3's documented 131k set-up: factor 4 over 32,768 original positions."""
    cfg = json.load(open(os.path.join(tiny_model_factory("qwen3"), "config.json")))
    cfg["max_position_embeddings"] = 40960
    cfg["rope_parameters"] = {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768
    }
    assert ModelConfig.from_dict(cfg).context_length == 131072


def edited_copy(source: str, dest, **changes) -> str:
    """A copy of the tiny model at ``source`` with config.json keys set to ``changes``."""
    shutil.copytree(source, dest)
    path = os.path.join(dest, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))
    return str(dest)


@pytest.mark.parametrize("arch,rope_type", [("qwen3", "yarn"), ("llama", "llama3")])
def test_a_top_level_original_max_position_embeddings_wins(tiny_model_factory, tmp_path, arch, rope_type):
    """Phi-3-style configs keep the pretraining length beside ``rope_parameters``; transformers' rotary embedding
    takes it over the dict's (tpserve took max_position_embeddings: every token differed)."""
    model_dir = edited_copy(tiny_model_factory(arch, rope_type=rope_type), tmp_path / "m",
                            original_max_position_embeddings=16)
    assert ModelConfig.from_pretrained(model_dir).rope_parameters["original_max_position_embeddings"] == 16
    check_against_transformers(model_dir, f"{arch} {rope_type}, top-level original_max_position_embeddings")


def test_a_tied_config_whose_checkpoint_has_its_own_lm_head_uses_it(tiny_model_factory, tmp_path):
    """tie_word_embeddings true, yet the checkpoint holds a different lm_head.weight: transformers unties and uses
    it (tpserve skipped it and tied: other tokens); an lm_head equal to the embeddings stays tied."""
    source = tiny_model_factory("qwen3")
    assert not json.load(open(os.path.join(source, "config.json"))).get("tie_word_embeddings")
    model_dir = edited_copy(source, tmp_path / "m", tie_word_embeddings=True)
    check_against_transformers(model_dir, "tied config, own lm_head")
    from safetensors.torch import load_file, save_file

    (path,) = [os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors")]
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    engine = Engine(EngineConfig(model=model_dir, device="cpu"))
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    engine.shutdown()


def base_config(arch: str = "qwen3") -> dict:
    cfg = {
        "architectures": [{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                           "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                           "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[arch]],
        "model_type": arch, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    }
    return cfg


@pytest.mark.parametrize(
    "arch,change,message",
    [
        ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         "rope_parameters.rope_type 'dynamic' is not supported"),
        ("llama", {"rope_theta": 1e4, "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
         "rope_scaling.rope_type 'longrope' is not supported"),
        ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor 0.5 is not supported"),
        ("llama", {"mlp_bias": True}, "mlp_bias true is not supported"),
        ("llama", {"attention_bias": True}, "attention_bias true"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ("qwen3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
        ("qwen3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping is not supported"),
    ],
)
def test_unsupported_settings_are_errors(arch, change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        ModelConfig.from_dict({**base_config(arch), **change})


def test_swish_is_silu():
    assert ModelConfig.from_dict({**base_config("llama"), "hidden_act": "swish"}) == ModelConfig.from_dict(base_config("llama"))


@pytest.mark.parametrize("value", [0, -2])
@pytest.mark.parametrize(
    "arch, key",
    [(arch, key) for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
     for arch in ("qwen3", "llama")] + [("qwen3_moe", "moe_intermediate_size")],
)
def test_sizes_that_are_not_positive_are_errors_naming_them(arch, key, value):
    """Were crashes in the ranks (or silently replaced: num_key_value_heads 0 became MHA)."""
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32} if arch == "qwen3_moe" else {}
    with pytest.raises(ValueError, match=f"config.json: {key} must be a positive integer, got {value}"):
        ModelConfig.from_dict({**base_config(arch), **moe, key: value})


def test_query_heads_must_be_a_multiple_of_the_kv_heads():
    with pytest.raises(ValueError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        ModelConfig.from_dict({**base_config(), "num_key_value_heads": 3})


def test_sliding_windows_are_read_as_transformers_reads_them():
    """Which layers attend within sliding_window (test_sliding_window.py checks their tokens against transformers'); the
    context is not capped by it."""
    mistral = ModelConfig.from_dict({**base_config("mistral"), "sliding_window": 1024})
    assert mistral.layer_windows == (1024, 1024) and mistral.context_length == 4096
    qwen2 = ModelConfig.from_dict({**base_config("qwen2"), "use_sliding_window": True, "sliding_window": 512,
                                   "max_window_layers": 1})
    assert qwen2.layer_windows == (0, 512) and qwen2.context_length == 4096
    no_window_layers = ModelConfig.from_dict({**base_config("qwen2"), "use_sliding_window": True,
                                              "sliding_window": 512, "max_window_layers": 2})
    assert no_window_layers.layer_windows == (0, 0) and no_window_layers.sliding_window is None
    unused = ModelConfig.from_dict({**base_config("qwen2"), "use_sliding_window": False, "sliding_window": 512,
                                    "max_window_layers": 0})
    assert unused.layer_windows == (0, 0)
    assert ModelConfig.from_dict({**base_config("mistral"), "sliding_window": None}).layer_windows == (0, 0)
    # transformers' Qwen3-MoE windows every layer whatever layer_types says (a probe's config.json carried both)
    moe = {**base_config("qwen3_moe"), "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "use_sliding_window": True, "sliding_window": 16}
    assert ModelConfig.from_dict(moe).layer_windows == (16, 16)
    assert ModelConfig.from_dict({**moe, "layer_types": ["full_attention"] * 2}).layer_windows == (16, 16)
    assert ModelConfig.from_dict({**moe, "use_sliding_window": False}).layer_windows == (0, 0)
    for bad in (0, -4):  # (a float or a string: transformers' own error, naming the field)
        with pytest.raises(ValueError, match=rf"sliding_window must be a positive integer or null, got {bad!r}"):
            ModelConfig.from_dict({**base_config("mistral"), "sliding_window": bad})


REAL_CONFIGS = os.path.join(os.path.dirname(__file__), "..", "data", "configs")


@pytest.mark.parametrize(
    "name,rope_type,theta,context",
    [
        ("Qwen3-8B", "default", 1e6, 40960),
        ("Qwen3-32B", "default", 1e6, 40960),
        ("Qwen2.5-7B-Instruct", "default", 1e6, 32768),  # sliding_window set but use_sliding_window false
        ("Llama-3.1-8B-Instruct", "llama3", 5e5, 131072),
    ],
)
def test_real_configs(name, rope_type, theta, context):
    """The real config.json files of common models (copied from the model hubs into tests/data)."""
    cfg = ModelConfig.from_pretrained(os.path.join(REAL_CONFIGS, name))
    assert cfg.rope_parameters["rope_type"] == rope_type
    assert cfg.rope_theta == theta and cfg.context_length == context


def test_qwen3_moe_real_config():
    """Qwen3-30B-A3B: 128 experts, top-8, every layer sparse; moe_intermediate_size 768 splits over
    TP 1-256 by powers of two, not over 5."""
    cfg = ModelConfig.from_pretrained(os.path.join(REAL_CONFIGS, "Qwen3-30B-A3B"))
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm
    moe = cfg.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 8, 768)
    assert moe.norm_topk_prob and moe.layers == tuple(range(48)) and cfg.dense_layers == ()
    assert cfg.rope_theta == 1e6 and cfg.context_length == 40960
    for tp in (1, 2, 4, 8):
        cfg.check_tp_size(tp)


def test_mixtral_and_qwen2_moe_real_configs():
    """Mixtral-8x7B-v0.1 and Qwen1.5-MoE-A2.7B as published (tests/data/configs: the fields their config.json holds,
    as public repositories quote them): their experts, shared expert and the TP sizes they split over."""
    mixtral = ModelConfig.from_pretrained(os.path.join(REAL_CONFIGS, "Mixtral-8x7B-v0.1"))
    assert mixtral.moe == MoEConfig(8, 2, 14336, True, tuple(range(32)), 0, "intermediate_size")
    assert (mixtral.head_dim, mixtral.rope_theta, mixtral.context_length) == (128, 1e6, 32768)
    for tp in (1, 2, 4, 8):
        mixtral.check_tp_size(tp)
        mixtral.check_tp_size(tp, expert_parallel=True)
    qwen = ModelConfig.from_pretrained(os.path.join(REAL_CONFIGS, "Qwen1.5-MoE-A2.7B"))
    assert qwen.moe == MoEConfig(60, 4, 1408, False, tuple(range(24)), 5632) and qwen.qkv_bias
    assert qwen.context_length == 8192  # sliding_window set, use_sliding_window false: no window
    for tp in (1, 2, 4):
        qwen.check_tp_size(tp)
    with pytest.raises(ValueError, match="tp_size 8 does not divide num_experts 60"):
        qwen.check_tp_size(8, expert_parallel=True)


def test_olmoe_clip_qkv_matches_transformers(tiny_model_factory, tmp_path):
    """OLMoE's clip_qkv clamps q, k (after their norms) and v, as transformers does; a clamp that changes the logits."""
    plain = tiny_model_factory("olmoe")
    clipped = edited_copy(plain, tmp_path / "clipped", clip_qkv=1.5)
    ids = list(range(30, 70))
    assert (hf_logits(plain, ids) - hf_logits(clipped, ids)).abs().max() > 0.1
    check_against_transformers(clipped, "olmoe, clip_qkv 1.5")
    with LLM(clipped, tp_size=2, device="cpu", page_size=8) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(clipped, p, 12) for p in PROMPTS]


def test_olmoe_real_config():
    """OLMoE-1B-7B-0924 as published: 64 experts of 1,024 features in every layer, top 8 not renormalised, its q/k
    RMSNorms over the whole projections (not per head); 16 heads split over up to 16 ranks."""
    cfg = ModelConfig.from_pretrained(os.path.join(REAL_CONFIGS, "OLMoE-1B-7B-0924"))
    assert cfg.moe == MoEConfig(64, 8, 1024, False, tuple(range(16)), 0, "intermediate_size")
    assert cfg.projection_qk_norm and not cfg.qk_norm and not cfg.qkv_bias
    assert (cfg.head_dim, cfg.rope_theta, cfg.context_length, cfg.eos_token_ids) == (128, 1e4, 4096, (50279,))
    for tp in (1, 2, 4, 8, 16):
        cfg.check_tp_size(tp)
        cfg.check_tp_size(tp, expert_parallel=True)
    published = json.load(open(os.path.join(REAL_CONFIGS, "OLMoE-1B-7B-0924", "config.json")))
    assert ModelConfig.from_dict(dict(published, clip_qkv=8.0)).clip_qkv == 8.0 and cfg.clip_qkv is None
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=f"clip_qkv {bad!r} is not supported"):
            ModelConfig.from_dict(dict(published, clip_qkv=bad))
    with pytest.raises(ValueError, match="cannot be read as a olmoe config: .*clip_qkv"):  # transformers' type check
        ModelConfig.from_dict(dict(published, clip_qkv="8"))
    # transformers' q_norm is hidden_size wide: heads that do not fill it cannot be an OLMoE
    with pytest.raises(ValueError, match="olmoe: head_dim 64 x num_attention_heads 16 must equal hidden_size 2048"):
        ModelConfig.from_dict(dict(published, head_dim=64))
    assert ModelConfig.from_dict(dict(published, head_dim=128)).head_dim == 128


def test_qwen3_moe_fp8_real_config():
    """Qwen3-30B-A3B-FP8's layout (the real config with Qwen's quantization_config, routers unconverted): its
    experts' 768 intermediate features split into whole 128-blocks at TP 2 (384), not at TP 4 (192)."""
    cfg = ModelConfig.from_pretrained(os.path.join(REAL_CONFIGS, "Qwen3-30B-A3B-FP8"))
    assert cfg.quantization is not None and cfg.quantization.block_size == (128, 128)
    assert not cfg.quantization.converts("model.layers.47.mlp.gate") and cfg.quantization.converts("model.layers.47.mlp.experts")
    for tp in (1, 2):
        cfg.check_tp_size(tp)
    with pytest.raises(ValueError, match=r"each rank's share of the expert gate/up output features \(moe_intermediate_size\) "
                       r"is 192, not a multiple of the FP8 weight block 128"):
        cfg.check_tp_size(4)


@pytest.mark.parametrize(
    "change,sparse",
    [
        ({"mlp_only_layers": [0, 2]}, (1, 3)),
        ({"decoder_sparse_step": 2}, (1, 3)),
        ({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, (1,)),
        ({"num_experts": 0}, None),
    ],
)
def test_qwen3_moe_sparse_layers(change, sparse):
    """transformers' rule: sparse where not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0."""
    cfg = ModelConfig.from_dict({**base_config("qwen3_moe"), "num_hidden_layers": 4, **change})
    assert (cfg.moe.layers if cfg.moe else None) == sparse


def test_qwen3_moe_tp_errors_name_the_expert_size():
    cfg = ModelConfig.from_dict({**base_config("qwen3_moe"), "num_attention_heads": 32, "num_key_value_heads": 4,
                                 "intermediate_size": 100, "moe_intermediate_size": 48, "mlp_only_layers": []})
    with pytest.raises(ValueError, match="tp_size 32 does not divide moe_intermediate_size 48"):
        cfg.check_tp_size(32)
    cfg.check_tp_size(16)  # the dense intermediate_size (no dense layer here) is not checked
    # expert parallelism: whole experts, so num_experts must divide instead
    cfg.check_tp_size(32, expert_parallel=True)  # 128 experts (transformers' default), 4 a rank
    uneven = ModelConfig.from_dict({**base_config("qwen3_moe"), "num_attention_heads": 32, "num_key_value_heads": 4,
                                    "num_experts": 48, "mlp_only_layers": []})
    with pytest.raises(ValueError, match=r"tp_size 32 does not divide num_experts 48 \(expert parallelism"):
        uneven.check_tp_size(32, expert_parallel=True)
    uneven.check_tp_size(16, expert_parallel=True)
    wide = ModelConfig.from_dict({**base_config("qwen3_moe"), "num_attention_heads": 32, "num_key_value_heads": 4,
                                  "moe_intermediate_size": 50, "num_experts": 32, "mlp_only_layers": []})
    with pytest.raises(ValueError, match=r"expert parallelism \(expert_parallel=True\) keeps experts whole"):
        wide.check_tp_size(4)
    wide.check_tp_size(4, expert_parallel=True)


def test_mixtral_config():
    """Mixtral: every layer sparse, its experts intermediate_size wide, the top k always renormalised; the window
    applies to every layer, as Mistral's."""
    cfg = ModelConfig.from_dict({**base_config("mixtral"), "num_local_experts": 8, "num_experts_per_tok": 2,
                                 "intermediate_size": 96, "sliding_window": 1024})
    assert cfg.moe == MoEConfig(8, 2, 96, True, (0, 1), 0, "intermediate_size") and cfg.dense_layers == ()
    assert not cfg.qk_norm and not cfg.qkv_bias and cfg.layer_windows == (1024, 1024)
    cfg.check_tp_size(2)
    with pytest.raises(ValueError, match="tp_size 4 does not divide num_experts 6 .expert parallelism"):
        ModelConfig.from_dict({**base_config("mixtral"), "num_attention_heads": 8, "num_key_value_heads": 8,
                               "num_local_experts": 6}).check_tp_size(4, expert_parallel=True)
    with pytest.raises(ValueError, match="config.json: num_local_experts must be a positive integer, got 0"):
        ModelConfig.from_dict({**base_config("mixtral"), "num_local_experts": 0})
    with pytest.raises(ValueError, match=r"num_experts_per_tok 3 must be in \[1, num_experts 2\]"):
        ModelConfig.from_dict({**base_config("mixtral"), "num_local_experts": 2, "num_experts_per_tok": 3})


def test_mixtral_errors_name_its_own_size_key_and_dense_only_moe_configs_are_dense():
    """Mixtral's experts are intermediate_size wide (it has no moe_intermediate_size); a Qwen2-MoE whose
    decoder_sparse_step leaves no layer sparse is a dense model (transformers builds no expert), so neither the experts'
    nor the shared expert's width constrains the TP size."""
    mixtral = ModelConfig.from_dict({**base_config("mixtral"), "num_attention_heads": 8, "num_key_value_heads": 8,
                                     "num_local_experts": 8, "intermediate_size": 6})
    with pytest.raises(ValueError, match=r"tp_size 4 does not divide intermediate_size 6 \(each rank holds a slice"):
        mixtral.check_tp_size(4)
    dense = ModelConfig.from_dict({**base_config("qwen2_moe"), "num_attention_heads": 8, "num_key_value_heads": 8,
                                   "intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 6, "shared_expert_intermediate_size": 6,
                                   "decoder_sparse_step": 5})
    assert dense.moe is None and dense.dense_layers == (0, 1)
    dense.check_tp_size(4)


def test_mistral_and_mixtral_window_every_layer_whatever_layer_types_says():
    """transformers' Mistral and Mixtral apply sliding_window to every layer and ignore a config.json's layer_types."""
    for arch, extra in (("mistral", {}), ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2})):
        cfg = ModelConfig.from_dict({**base_config(arch), **extra, "sliding_window": 16,
                                     "layer_types": ["full_attention"] * 2})
        assert cfg.layer_windows == (16, 16), arch


def test_qwen2_moe_config():
    """Qwen2-MoE: q/k/v biases (qkv_bias), transformers' sparse-layer rule, the shared expert's width, checked
    against the TP size like a dense MLP's."""
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
           "mlp_only_layers": [0], "norm_topk_prob": False}
    cfg = ModelConfig.from_dict({**base_config("qwen2_moe"), **moe})
    assert cfg.moe == MoEConfig(4, 2, 32, False, (1,), 48) and cfg.dense_layers == (0,)
    assert cfg.qkv_bias and not cfg.qk_norm
    assert not ModelConfig.from_dict({**base_config("qwen2_moe"), **moe, "qkv_bias": False}).qkv_bias
    cfg.check_tp_size(2)
    wide = ModelConfig.from_dict({**base_config("qwen2_moe"), **moe, "num_attention_heads": 32, "num_key_value_heads": 32,
                                  "intermediate_size": 256, "num_experts": 32})
    with pytest.raises(ValueError, match="tp_size 32 does not divide shared_expert_intermediate_size 48"):
        wide.check_tp_size(32, expert_parallel=True)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size must be an integer >= 0, got -1"):
        ModelConfig.from_dict({**base_config("qwen2_moe"), **moe, "shared_expert_intermediate_size": -1})
    assert ModelConfig.from_dict({**base_config("qwen2_moe"), **moe, "shared_expert_intermediate_size": 0}).moe.shared_intermediate_size == 0


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="unsupported architecture .'DeepseekV3ForCausalLM'."):
        ModelConfig.from_dict({**base_config("qwen3"), "architectures": ["DeepseekV3ForCausalLM"]})


@pytest.mark.parametrize(
    "change, message",
    [
        # were an AttributeError from transformers ("'str' object has no attribute 'to_dict'"): a traceback
        # from the CLI and from tpserve plan
        ({"quantization_config": "fp8"}, "config.json: quantization_config must be an object, got 'fp8'"),
        ({"quantization_config": [1]}, r"config.json: quantization_config must be an object, got \[1\]"),
        # a TypeError ("'int' object is not iterable"), or "unsupported architecture Qwen3ForCausalLM"
        ({"architectures": 5}, "config.json: architectures must be a list of class names, got 5"),
        ({"architectures": [["Qwen3ForCausalLM"]]}, "config.json: architectures must be a list of class names, got"),
        ({"architectures": "Qwen3ForCausalLM"}, "config.json: architectures must be a list of class names, got 'Qwen3"),
    ],
)
def test_config_keys_of_the_wrong_type_are_errors_naming_them(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**base_config("qwen3"), **change})
