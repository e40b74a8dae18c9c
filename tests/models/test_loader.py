"""Streaming sharded loading: errors for missing/unexpected weights, dummy weights."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tpserve import LLM, SamplingParams
from tpserve.config import ModelConfig
from tpserve.engine_config import EngineConfig
from tpserve.distributed.comm import SingleRankCommunicator
from tpserve.distributed.info import set_tp_info
from tpserve.engine.engine import Engine
from tpserve.models.decoder import CausalLM
from tpserve.models.loader import checkpoint_name, checkpoint_target, load_safetensors, materialize, safetensors_files
from tpserve.models.names import spelled_for


def copy_model(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def test_checkpoint_names_map_to_merged_parameters():
    assert checkpoint_target("model.layers.3.self_attn.k_proj.weight") == ("model.layers.3.self_attn.qkv_proj", "weight", "k")
    assert checkpoint_target("model.layers.0.mlp.up_proj.weight") == ("model.layers.0.mlp.gate_up_proj", "weight", 1)
    assert checkpoint_target("model.norm.weight") == ("model.norm", "weight", None)
    for name in ("model.layers.3.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight_scale_inv",
                 "model.norm.weight", "model.layers.1.mlp.experts.6.gate_proj.weight_scale_inv"):
        assert checkpoint_name(checkpoint_target(name)) == name  # how a missing weight is named


def test_sharded_checkpoint_loads_like_single_file(tiny_model_factory):
    sharded = tiny_model_factory("qwen3", num_shards=3)
    single = tiny_model_factory("qwen3")
    assert len(safetensors_files(sharded)) == 3
    a = Engine(EngineConfig(model=sharded, device="cpu")).model.state_dict()
    b = Engine(EngineConfig(model=single, device="cpu")).model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "arch,removed,message",
    [
        # named as the checkpoint names them, not by tpserve's merged parameters (qkv_proj (v), experts.down_proj ((6, 0)))
        ("qwen3", "model.layers.1.self_attn.v_proj.weight", r"missing from the checkpoint: model\.layers\.1\.self_attn\.v_proj\.weight$"),
        ("qwen3", "model.layers.0.mlp.up_proj.weight", r"missing from the checkpoint: model\.layers\.0\.mlp\.up_proj\.weight$"),
        ("qwen3_moe", "model.layers.1.mlp.experts.6.down_proj.weight",
         r"missing from the checkpoint: model\.layers\.1\.mlp\.experts\.6\.down_proj\.weight$"),
        # in Mixtral's own spelling, not the Qwen names tpserve's modules use
        ("mixtral", "model.layers.1.block_sparse_moe.experts.6.w3.weight",
         r"missing from the checkpoint: model\.layers\.1\.block_sparse_moe\.experts\.6\.w3\.weight$"),
        ("mixtral", "model.layers.0.block_sparse_moe.gate.weight",
         r"missing from the checkpoint: model\.layers\.0\.block_sparse_moe\.gate\.weight$"),
        ("qwen2_moe", "model.layers.1.mlp.shared_expert.up_proj.weight",
         r"missing from the checkpoint: model\.layers\.1\.mlp\.shared_expert\.up_proj\.weight$"),
        ("qwen2_moe", "model.layers.1.mlp.shared_expert_gate.weight",
         r"missing from the checkpoint: model\.layers\.1\.mlp\.shared_expert_gate\.weight$"),
    ],
)
def test_missing_weight_is_named(tiny_model_factory, tmp_path, arch, removed, message):
    model_dir = copy_model(tiny_model_factory(arch), str(tmp_path / "m"))
    path = os.path.join(model_dir, "model.safetensors")
    weights = load_file(path)
    del weights[removed]
    save_file(weights, path)
    with pytest.raises(ValueError, match=message):
        Engine(EngineConfig(model=model_dir, device="cpu"))


def test_unexpected_weight_is_named(tiny_model_factory, tmp_path):
    model_dir = copy_model(tiny_model_factory("qwen3"), str(tmp_path / "m"))
    path = os.path.join(model_dir, "model.safetensors")
    weights = load_file(path)
    weights["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(weights, path)
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.mlp\.extra_proj\.weight'"):
        Engine(EngineConfig(model=model_dir, device="cpu"))


def test_integer_weights_are_named(tiny_model_factory, tmp_path):
    """An integer tensor where a weight belongs would be converted to floats silently."""
    model_dir = copy_model(tiny_model_factory("qwen3"), str(tmp_path / "m"))
    path = os.path.join(model_dir, "model.safetensors")
    weights = load_file(path)
    weights["model.layers.1.self_attn.o_proj.weight"] = weights["model.layers.1.self_attn.o_proj.weight"].to(torch.int32)
    save_file(weights, path)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.o_proj\.weight' is int32, not a floating-point"):
        Engine(EngineConfig(model=model_dir, device="cpu"))


def test_wrong_shape_is_named(tiny_model_factory, tmp_path):
    model_dir = copy_model(tiny_model_factory("qwen3"), str(tmp_path / "m"))
    path = os.path.join(model_dir, "model.safetensors")
    weights = load_file(path)
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, path)
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.norm\.weight' of shape \(3,\) does not fit"):
        Engine(EngineConfig(model=model_dir, device="cpu"))
    weights = load_file(path)
    weights["model.norm.weight"] = torch.ones(64)
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"][:5].clone()
    save_file(weights, path)
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.layers\.0\.mlp\.up_proj\.weight' of shape "
                       r"\(5, 64\) does not fit the model config\.json describes: .*with 128 along dim 0"):
        Engine(EngineConfig(model=model_dir, device="cpu"))  # was "weight weight: expected 128 ...", naming no tensor


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


def test_expert_names_map_to_stacked_experts():
    assert checkpoint_target("model.layers.2.mlp.experts.5.up_proj.weight") == ("model.layers.2.mlp.experts", "gate_up_proj", (5, 1))
    assert checkpoint_target("model.layers.2.mlp.experts.0.down_proj.weight") == ("model.layers.2.mlp.experts", "down_proj", (0, 0))
    assert checkpoint_target("model.layers.2.mlp.gate.weight") == ("model.layers.2.mlp.gate", "weight", None)


def test_mixtral_names_map_to_the_same_modules():
    """Mixtral's block_sparse_moe and w1 (gate) / w3 (up) / w2 (down) load where Qwen's MoE names do."""
    assert checkpoint_target("model.layers.2.block_sparse_moe.experts.5.w3.weight") == (
        "model.layers.2.mlp.experts", "gate_up_proj", (5, 1))
    assert checkpoint_target("model.layers.2.block_sparse_moe.experts.0.w2.weight") == (
        "model.layers.2.mlp.experts", "down_proj", (0, 0))
    assert checkpoint_target("model.layers.2.block_sparse_moe.experts.1.w1.weight_scale_inv") == (
        "model.layers.2.mlp.experts", "gate_up_proj_scale_inv", (1, 0))
    assert checkpoint_target("model.layers.2.block_sparse_moe.gate.weight") == ("model.layers.2.mlp.gate", "weight", None)
    for name in ("model.layers.3.block_sparse_moe.experts.6.w1.weight", "model.layers.0.block_sparse_moe.gate.weight",
                 "model.layers.1.self_attn.o_proj.weight"):
        assert spelled_for("MixtralForCausalLM", checkpoint_name(checkpoint_target(name))) == name
    assert spelled_for("Qwen3MoeForCausalLM", "model.layers.0.mlp.experts.1.gate_proj.weight") == (
        "model.layers.0.mlp.experts.1.gate_proj.weight")


def rank_state(model_dir: str, rank: int, size: int, expert_parallel: bool = False) -> dict[str, torch.Tensor]:
    """One TP rank's loaded parameters, built in this process (no forward pass, so no process group)."""
    set_tp_info(rank, size, expert_parallel)
    try:
        with torch.device("meta"):
            model = CausalLM(ModelConfig.from_pretrained(model_dir), SingleRankCommunicator(), 64)
        materialize(model, torch.device("cpu"), torch.float32)
        load_safetensors(model, model_dir)
        return model.state_dict()
    finally:
        set_tp_info(0, 1)


def stacked_experts_checkpoint(weights: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """transformers' in-memory layout: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    out = {k: v for k, v in weights.items() if ".mlp.experts." not in k}
    layers = {k.split(".mlp.experts.")[0] for k in weights if ".mlp.experts." in k}
    for layer in layers:
        p = f"{layer}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack(
            [torch.cat([weights[f"{p}{e}.gate_proj.weight"], weights[f"{p}{e}.up_proj.weight"]]) for e in range(num_experts)]
        )
        out[p + "down_proj"] = torch.stack([weights[f"{p}{e}.down_proj.weight"] for e in range(num_experts)])
    return out


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_stacked_and_per_expert_checkpoints_load_alike(tiny_model_factory, tmp_path, tp_rank):
    """Both expert layouts give the same parameters (each rank its slice of every expert)."""
    per_expert = tiny_model_factory("qwen3_moe", num_layers=3)
    stacked = copy_model(per_expert, str(tmp_path / "stacked"))
    path = os.path.join(stacked, "model.safetensors")
    save_file(stacked_experts_checkpoint(load_file(path), 8), path)
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(path)
    a, b = rank_state(per_expert, tp_rank, 2), rank_state(stacked, tp_rank, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    full = load_file(os.path.join(per_expert, "model.safetensors"))
    up = full["model.layers.2.mlp.experts.3.up_proj.weight"]  # [I, H], I = 32
    got = a["model.layers.2.mlp.experts.gate_up_proj"]  # [E, 2 * 16, H]
    assert torch.equal(got[3, 16:], up[16 * tp_rank : 16 * (tp_rank + 1)])


def test_dummy_moe_weights_from_the_real_config_shape(tmp_path):
    """load_format dummy on Qwen3-30B-A3B's config with its sizes cut down (same keys, same layout)."""
    real = os.path.join(os.path.dirname(__file__), "..", "data", "configs", "Qwen3-30B-A3B", "config.json")
    cfg = json.load(open(real))
    cfg.update(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", load_format="dummy", max_total_tokens=256))
    params = dict(engine.model.named_parameters())
    assert params["model.layers.1.mlp.experts.gate_up_proj"].shape == (16, 64, 64)
    assert params["model.layers.1.mlp.experts.down_proj"].std() > 0.01
    out = LLM(str(tmp_path), device="cpu", load_format="dummy", max_total_tokens=256).generate(
        [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].token_ids) == 4


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)


def _write(text: str):
    return lambda path: open(path, "w").write(text)


@pytest.mark.parametrize(
    "name, damage, message",
    [
        ("model-00002-of-00003.safetensors", _truncate,
         r"model-00002-of-00003\.safetensors is not a readable safetensors file \(.*\); download it again"),
        ("model-00001-of-00003.safetensors", _write("not safetensors"),
         r"model-00001-of-00003\.safetensors is not a readable safetensors file"),
        ("model-00003-of-00003.safetensors", os.remove,
         r"model\.safetensors\.index\.json names model-00003-of-00003\.safetensors, which is not in "),
        ("model.safetensors.index.json", _write("{"), r"model\.safetensors\.index\.json is not valid JSON"),
        ("model.safetensors.index.json", _write('{"metadata": {}}'),
         r"model\.safetensors\.index\.json has no weight_map"),
    ],
    ids=["truncated", "garbage", "missing shard", "bad index", "index without weight_map"],
)
def test_damaged_checkpoint_files_are_named_before_anything_starts(tiny_model_factory, tmp_path, name, damage, message):
    """A partial download is one error naming the file, from the LLM's constructor (and the CLI's
    argument checks), not a safetensors error without a file name from every rank."""
    model_dir = copy_model(tiny_model_factory("qwen3", num_shards=3), str(tmp_path / "m"))
    damage(os.path.join(model_dir, name))
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        LLM(model_dir, device="cpu")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        Engine(EngineConfig(model=model_dir, device="cpu"))


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_expert_parallel_ranks_load_whole_experts(tiny_model_factory, tmp_path, monkeypatch, layout):
    """Expert parallelism: rank r of 2 holds experts 4r..4r+3 whole, as the checkpoint has them; the rest
    of the model is cut as under TP. Other ranks' per-expert tensors are not even read."""
    import tpserve.models.loader as loader

    model_dir = tiny_model_factory("qwen3_moe", num_layers=3, moe_intermediate_size=30)  # 30: TP 4 cannot cut it
    if layout == "stacked":
        model_dir = copy_model(model_dir, str(tmp_path / "stacked"))
        path = os.path.join(model_dir, "model.safetensors")
        save_file(stacked_experts_checkpoint(load_file(path), 8), path)
    read: list[str] = []
    opened = loader.open_safetensors

    class Recording:
        def __init__(self, path: str) -> None:
            self.handle = opened(path)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.handle.get_tensor(name)

    monkeypatch.setattr(loader, "open_safetensors", Recording)
    full, tp = rank_state(model_dir, 0, 1), rank_state(model_dir, 1, 2)
    read.clear()
    ep = rank_state(model_dir, 1, 2, expert_parallel=True)
    prefix = "model.layers.1.mlp.experts."
    assert ep[prefix + "gate_up_proj"].shape == (4, 60, 64) and ep[prefix + "down_proj"].shape == (4, 64, 30)
    assert torch.equal(ep[prefix + "gate_up_proj"], full[prefix + "gate_up_proj"][4:])
    assert torch.equal(ep[prefix + "down_proj"], full[prefix + "down_proj"][4:])
    assert torch.equal(ep["model.layers.1.mlp.gate.weight"], full["model.layers.1.mlp.gate.weight"])
    for name in ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"):
        assert torch.equal(ep[name], tp[name]), name  # attention and the dense layer stay tensor-parallel
    if layout == "per_expert":
        experts_read = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
        assert experts_read == {4, 5, 6, 7}
