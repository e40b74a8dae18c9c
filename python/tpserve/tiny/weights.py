"""A tiny model's random weights: seeded per tensor, scaled so the model is not degenerate,
written as safetensors (optionally sharded, with an index)."""

from __future__ import annotations

import json
import os
import zlib
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def weight_shapes(config: PreTrainedConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes for a transformers config, in checkpoint order."""
    h, inter, arch = config.hidden_size, config.intermediate_size, config.model_type
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads  # qwen2 has no head_dim setting
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    mixtral = arch == "mixtral"
    num_experts = config.num_local_experts if mixtral else getattr(config, "num_experts", 0)
    all_sparse = arch in ("mixtral", "olmoe")
    expert_size = inter if all_sparse else getattr(config, "moe_intermediate_size", 0)
    dense_layers = () if all_sparse else getattr(config, "mlp_only_layers", ())
    shared = getattr(config, "shared_expert_intermediate_size", 0)  # qwen2_moe only
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if arch == "phi3":  # q/k/v and gate/up fused
            shapes[p + "self_attn.qkv_proj.weight"] = (q_out + 2 * kv_out, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
            continue
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        if arch in ("qwen2", "qwen2_moe"):
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if arch in ("qwen3", "qwen3_moe", "gemma3_text"):
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if arch == "olmoe":  # over the whole projections
            shapes[p + "self_attn.q_norm.weight"] = (q_out,)
            shapes[p + "self_attn.k_norm.weight"] = (kv_out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if arch in ("gemma2", "gemma3_text"):  # the MLP's sandwich
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if num_experts and i not in dense_layers:
            shapes.update(_sparse_mlp_shapes(p, h, num_experts, expert_size, shared, mixtral))
            continue
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _sparse_mlp_shapes(
    prefix: str, h: int, num_experts: int, size: int, shared: int, mixtral: bool
) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router and per-expert tensors (as published checkpoints and save_pretrained write them;
    Mixtral's names: ``block_sparse_moe``, ``w1``/``w3``/``w2``), and Qwen2-MoE's shared expert and its gate."""
    block = prefix + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    shapes = {block + "gate.weight": (num_experts, h)}
    for e in range(num_experts):
        shapes[block + f"experts.{e}.{names[0]}.weight"] = (size, h)
        shapes[block + f"experts.{e}.{names[1]}.weight"] = (size, h)
        shapes[block + f"experts.{e}.{names[2]}.weight"] = (h, size)
    if shared:
        shapes[block + "shared_expert.gate_proj.weight"] = (shared, h)
        shapes[block + "shared_expert.up_proj.weight"] = (shared, h)
        shapes[block + "shared_expert.down_proj.weight"] = (h, shared)
        shapes[block + "shared_expert_gate.weight"] = (1, h)
    return shapes


_AMPLIFIED = ("q_proj.weight", "k_proj.weight", "o_proj.weight", "down_proj.weight", ".w2.weight")


def _init_tensor(name: str, shape: tuple[int, ...], seed: int, hidden_size: int) -> torch.Tensor:
    """Random tensor for one parameter, seeded by (seed, name) so it does not depend on order.

    Scales, chosen empirically so that greedy continuations vary with the prompt and rarely
    settle into repeating one token (with or without tied embeddings):
    - projections N(0, 1/fan_in) keep activations O(1); q/k get 3x and Qwen3's q/k norms weigh
      ~3, so attention is sharp and the context matters; o/down get 3x so the layers' outputs
      dominate the residual stream (otherwise a tied LM head mostly echoes the input token);
    - embeddings (also the tied LM head) N(0, 4/hidden): logits with std ~2;
    - other RMSNorm weights ~1 (+-10%); biases N(0, 0.5^2) so a missing bias shows.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return 3.0 * (1.0 + 0.1 * noise)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith(".bias"):
        return 0.5 * noise
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return noise * (2.0 / hidden_size**0.5)
    gain = 3.0 if name.endswith(_AMPLIFIED) else 1.0
    return noise * (gain / shape[1] ** 0.5)


_SANDWICH_OUTPUT_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")


def _gemma_norm(name: str, weight: torch.Tensor) -> torch.Tensor:
    """Gemma's norms multiply by (1 + weight): the same norms, stored so; the norms of the sublayers' outputs ~3 (as
    o/down are amplified elsewhere), else a tied LM head mostly echoes the input token."""
    return (3.0 * weight if name.endswith(_SANDWICH_OUTPUT_NORMS) else weight) - 1.0


def random_weights(config: PreTrainedConfig, seed: int) -> dict[str, torch.Tensor]:
    weights = {name: _init_tensor(name, shape, seed, config.hidden_size) for name, shape in weight_shapes(config).items()}
    if config.model_type in ("gemma2", "gemma3_text"):
        weights = {name: _gemma_norm(name, w) if name.endswith("norm.weight") else w for name, w in weights.items()}
    return weights


def _split_evenly(names: list[str], sizes: dict[str, int], num_shards: int) -> list[list[str]]:
    """Split ``names`` (kept in order) into exactly ``num_shards`` non-empty runs of ~equal bytes."""
    total = sum(sizes.values())
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    done, prev = 0, -1
    for i, name in enumerate(names):
        by_bytes = done * num_shards // total
        # Never skip a shard, and leave at least one tensor for each later shard.
        k = min(max(by_bytes, prev, num_shards - (len(names) - i)), prev + 1)
        shards[k].append(name)
        done, prev = done + sizes[name], k
    return shards


def _remove_old_weights(out_dir: str) -> None:
    """Rewriting a directory with another shard count must not leave the old files to be loaded."""
    for name in os.listdir(out_dir):
        if name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json")):
            os.remove(os.path.join(out_dir, name))


def write_weights(weights: dict[str, torch.Tensor], out_dir: str, num_shards: int) -> None:
    _remove_old_weights(out_dir)
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata=metadata)
        return
    sizes = {name: t.numel() * t.element_size() for name, t in weights.items()}
    weight_map: dict[str, str] = {}
    for k, names in enumerate(_split_evenly(list(weights), sizes, num_shards)):
        filename = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n] for n in names}, os.path.join(out_dir, filename), metadata=metadata)
        weight_map.update({n: filename for n in names})
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
