"""Streaming sharded loading: errors for missing/unexpected weights, dummy weights."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tpserve.config import EngineConfig
from tpserve.engine.engine import Engine
from tpserve.models.loader import checkpoint_target, safetensors_files


def copy_model(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def test_checkpoint_names_map_to_merged_parameters():
    assert checkpoint_target("model.layers.3.self_attn.k_proj.weight") == ("model.layers.3.self_attn.qkv_proj", "weight", "k")
    assert checkpoint_target("model.layers.0.mlp.up_proj.weight") == ("model.layers.0.mlp.gate_up_proj", "weight", 1)
    assert checkpoint_target("model.norm.weight") == ("model.norm", "weight", None)


def test_sharded_checkpoint_loads_like_single_file(tiny_model_factory):
    sharded = tiny_model_factory("qwen3", num_shards=3)
    single = tiny_model_factory("qwen3")
    assert len(safetensors_files(sharded)) == 3
    a = Engine(EngineConfig(model=sharded, device="cpu")).model.state_dict()
    b = Engine(EngineConfig(model=single, device="cpu")).model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_weight_is_named(tiny_model_factory, tmp_path):
    model_dir = copy_model(tiny_model_factory("qwen3"), str(tmp_path / "m"))
    path = os.path.join(model_dir, "model.safetensors")
    weights = load_file(path)
    del weights["model.layers.1.self_attn.v_proj.weight"]
    save_file(weights, path)
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.qkv_proj\.weight \(v\)"):
        Engine(EngineConfig(model=model_dir, device="cpu"))


def test_unexpected_weight_is_named(tiny_model_factory, tmp_path):
    model_dir = copy_model(tiny_model_factory("qwen3"), str(tmp_path / "m"))
    path = os.path.join(model_dir, "model.safetensors")
    weights = load_file(path)
    weights["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(weights, path)
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.mlp\.extra_proj\.weight'"):
        Engine(EngineConfig(model=model_dir, device="cpu"))


def test_wrong_shape_is_named(tiny_model_factory, tmp_path):
    model_dir = copy_model(tiny_model_factory("qwen3"), str(tmp_path / "m"))
    path = os.path.join(model_dir, "model.safetensors")
    weights = load_file(path)
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, path)
    with pytest.raises(ValueError, match="weight"):
        Engine(EngineConfig(model=model_dir, device="cpu"))


def test_dummy_weights_from_config_alone(tmp_path):
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", load_format="dummy", max_total_tokens=256))
    params = dict(engine.model.named_parameters())
    assert engine.dtype == torch.float32, "auto dtype is float32 on the CPU"
    assert torch.equal(params["model.norm.weight"], torch.ones(64))
    assert params["model.layers.0.mlp.gate_up_proj.weight"].std() > 0.01
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    with pytest.raises(FileNotFoundError, match="no .safetensors weights"):
        Engine(EngineConfig(model=str(tmp_path), device="cpu"))
