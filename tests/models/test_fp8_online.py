"""``quantization="fp8"`` on an unquantized checkpoint: weights quantized at load (128x128 blocks,
per rank); on the CPU they are dequantized again, so these tests check the numbers the GPU uses."""

from __future__ import annotations

import pytest
import torch

from agreement import agreement, describe
from tpserve import LLM, SamplingParams
from tpserve.engine_config import EngineConfig
from tpserve.engine.engine import Engine
from tpserve.quant.config import ONLINE_BLOCK_SIZE, QuantConfig, resolve_quantization
from tpserve.quant.fp8 import dequantize_blocks, quantize_blocks

QUANTIZED = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def test_weights_are_their_fp8_block_round_trip(qwen3_dir):
    plain = dict(Engine(EngineConfig(model=qwen3_dir, device="cpu", max_total_tokens=64)).model.named_parameters())
    fp8 = dict(Engine(EngineConfig(model=qwen3_dir, device="cpu", max_total_tokens=64, quantization="fp8")).model.named_parameters())
    assert plain.keys() == fp8.keys()
    for name, weight in plain.items():
        if name.endswith(QUANTIZED):
            expected = dequantize_blocks(*quantize_blocks(weight, ONLINE_BLOCK_SIZE), ONLINE_BLOCK_SIZE, torch.float32)
            assert torch.equal(fp8[name], expected), name
            assert not torch.equal(fp8[name], weight), name
        else:
            assert torch.equal(fp8[name], weight), name


def test_fp8_agrees_with_the_unquantized_model(qwen3_dir):
    """The tiny random model is built to be sensitive (sharp attention, amplified layers): even
    bfloat16 changes ~10% of its teacher-forced argmaxes. FP8 (3 mantissa bits) changes more;
    the figures are printed, the bounds are loose."""
    a = agreement(qwen3_dir, {"quantization": "fp8"})
    print(f"fp8 vs unquantized: {describe(a)}")
    err, same_argmax, first = a["err"], a["same_argmax"], a["first"]
    assert err < 0.6
    assert same_argmax >= 0.6
    assert first >= 0.5


def test_tp2_quantizes_each_rank_shard(tiny_model_factory):
    """Each rank quantizes its own shard. With every rank's part a whole number of 128-blocks
    (head_dim 128, intermediate 256) the blocks are TP 1's, so TP 2 computes what TP 1 does."""
    model = tiny_model_factory("qwen3", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=256)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 137))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        with LLM(model, tp_size=tp, device="cpu", quantization="fp8") as llm:
            outs.append([o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)])
    assert outs[0] == outs[1]


def test_which_quantization_runs(qwen3_dir):
    checkpoint = QuantConfig("fp8", (16, 16), prequantized=True)
    assert resolve_quantization(None, checkpoint) is checkpoint
    assert resolve_quantization("fp8", checkpoint) is checkpoint  # an FP8 checkpoint is served as published
    assert resolve_quantization("fp8", None) == QuantConfig("fp8", ONLINE_BLOCK_SIZE, prequantized=False)
    assert resolve_quantization(None, None) is None
    with pytest.raises(ValueError, match="quantization must be one of fp8, compressed-tensors, got 'int4'"):
        EngineConfig(model=qwen3_dir, quantization="int4")


EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def test_moe_experts_are_quantized_at_load_per_projection(tiny_model_factory):
    """A MoE model's experts are quantized too, each expert's gate, up and down on its own as it loads (the FP8
    checkpoints' layout), so its experts are their 128x128 block round trip; the router stays unquantized."""
    model = tiny_model_factory("qwen3_moe", num_layers=3, hidden_size=64, moe_intermediate_size=160)
    plain = dict(Engine(EngineConfig(model=model, device="cpu", max_total_tokens=64)).model.named_parameters())
    engine = Engine(EngineConfig(model=model, device="cpu", max_total_tokens=64, quantization="fp8"))
    fp8 = dict(engine.model.named_parameters())
    assert plain.keys() == fp8.keys() and "experts dequantized to float32" in engine._quantization_note()

    def round_trip(weight: torch.Tensor) -> torch.Tensor:
        return dequantize_blocks(*quantize_blocks(weight, ONLINE_BLOCK_SIZE), ONLINE_BLOCK_SIZE, torch.float32)

    checked = 0
    for name, weight in plain.items():
        if name.endswith(EXPERTS):
            # gate and up apart (160 rows each: the up rows' blocks start at row 160, not at 256 of the merged 320)
            parts = weight.chunk(2, dim=1) if name.endswith("gate_up_proj") else (weight,)
            expected = torch.cat([torch.stack([round_trip(p[e]) for e in range(p.shape[0])]) for p in parts], dim=1)
            assert torch.equal(fp8[name], expected) and not torch.equal(fp8[name], weight), name
            checked += 1
        elif name.endswith(QUANTIZED) or not name.endswith("mlp.gate.weight"):
            continue
        else:
            assert torch.equal(fp8[name], weight), name  # the router
    assert checked == 2 * 2  # two sparse layers (layer 0 dense)


def test_moe_tp2_quantizes_each_rank_slice_of_every_expert(tiny_model_factory):
    """At TP 2 each rank quantizes its slice of every expert; with each slice whole 128-blocks (intermediate 256)
    they are TP 1's blocks, so the greedy tokens are TP 1's, and expert parallelism (whole experts) gives them too."""
    model = tiny_model_factory("qwen3_moe", num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128,
                               moe_intermediate_size=256)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41], list(range(100, 137))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for tp, ep in ((1, False), (2, False), (2, True)):
        with LLM(model, tp_size=tp, device="cpu", quantization="fp8", expert_parallel=ep) as llm:
            outs[tp, ep] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert outs[1, False] == outs[2, False] == outs[2, True]


def test_float8_expert_tensor_in_a_checkpoint_quantized_at_load_is_an_error(tiny_model_factory, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    source = tiny_model_factory("qwen3_moe", num_layers=3)
    model = str(tmp_path / "model")
    shutil.copytree(source, model)
    path = f"{model}/model.safetensors"
    tensors = load_file(path)
    name = next(n for n in tensors if ".experts." in n and "down" in n)
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{name}' is float8_e4m3fn, but config.json has no "
                       r"quantization_config: --quantization fp8 quantizes"):
        Engine(EngineConfig(model=model, device="cpu", max_total_tokens=64, quantization="fp8"))
