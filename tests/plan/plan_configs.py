"""Model configs the planner's tests write themselves (only config.json: the planner reads no weights)."""

from __future__ import annotations

import json
import os

from tpserve.config import ModelConfig

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "configs")

# Seed 003's worked example.
LLAMA_3_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
# Qwen3-235B-A22B: 94 sparse layers of 128 experts (8 active), 235 B weights.
QWEN3_235B_A22B = {
    **QWEN3_0_6B, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
    "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
}


def write_config(directory: str, cfg: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return directory


def config(cfg: dict) -> ModelConfig:
    return ModelConfig.from_dict(cfg)


def data_config(name: str) -> str:
    return os.path.join(DATA, name)
