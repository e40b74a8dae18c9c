"""FP8 checkpoints in the published format (block-scaled float8_e4m3fn weights): config,
numerics, loading, TP sharding, against transformers on the dequantized weights (float32, CPU)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from reference import hf_greedy, hf_logits
from test_vs_transformers import PROMPTS, teacher_forced_logits
from tpserve import LLM, SamplingParams
from tpserve.config import ModelConfig
from tpserve.engine_config import EngineConfig, check_can_start
from tpserve.engine.engine import Engine
from tpserve.layers.linear import Slice
from tpserve.quant.config import QuantConfig, parse_quantization_config, resolve_quantization
from tpserve.quant.fp8 import FP8_DTYPE, FP8_MAX, dequantize_blocks, quantize_blocks
from fp8_checkpoint import write_compressed_tensors_checkpoint, write_dequantized, write_fp8_checkpoint
from safetensors.torch import load_file, save_file

PUBLISHED = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.fixture(scope="module")
def fp8_pair(tiny_model_factory, tmp_path_factory):
    """make(block, not_converted) -> (fp8 dir, dequantized dir), cached."""
    made: dict = {}

    def make(block: tuple[int, int], not_converted: tuple[str, ...] = ("lm_head",)) -> tuple[str, str]:
        key = (block, not_converted)
        if key not in made:
            root = tmp_path_factory.mktemp("fp8")
            fp8 = write_fp8_checkpoint(tiny_model_factory("qwen3"), str(root / "fp8"), block, not_converted)
            made[key] = fp8, write_dequantized(fp8, str(root / "ref"))
        return made[key]

    return make


def assert_greedy_matches_at_tp_1_and_2(fp8_dir: str, ref_dir: str) -> None:
    """Greedy tokens of the FP8 checkpoint at TP 1 and 2 equal transformers' on its dequantized weights."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [hf_greedy(ref_dir, p, 12) for p in PROMPTS]
    for tp in (1, 2):
        with LLM(fp8_dir, tp_size=tp, device="cpu", page_size=4) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == expected, f"tp {tp}"


def test_published_config_is_read():
    quant = parse_quantization_config({**PUBLISHED, "modules_to_not_convert": ["lm_head"]})
    assert quant == QuantConfig("fp8", (128, 128), prequantized=True, not_converted=("lm_head",))
    assert parse_quantization_config({**PUBLISHED, "ignored_layers": ["x"]}).not_converted == ("x",)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"quant_method": "awq"}, r"quantization_config\.quant_method: 'awq' is not supported"),
        ({"fmt": "e5m2"}, r"quantization_config\.fmt: 'e5m2'"),
        ({"activation_scheme": "mixed"}, r"quantization_config\.activation_scheme: 'mixed'"),
        # as vLLM: static activation scales come with per-tensor scales only
        ({"activation_scheme": "static"}, r"activation_scheme: 'static' is not supported with weight_block_size"),
        ({"weight_block_size": [128]}, r"weight_block_size: must be two positive integers"),
        ({"kv_cache_scheme": {}}, r"quantization_config\.kv_cache_scheme: is not supported"),
        ({"modules_to_not_convert": "lm_head"}, r"modules_to_not_convert: must be a list"),
    ],
)
def test_unsupported_quantization_configs_name_the_key(change, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization_config({**PUBLISHED, **change})


def test_per_tensor_fp8_config_is_read():
    """The older FP8 format (no weight_block_size; a weight_scale per tensor, and an input_scale where static), as vLLM
    reads it: held as a scale per row."""
    for scheme in ("static", "dynamic"):
        quant = parse_quantization_config({"quant_method": "fp8", "activation_scheme": scheme, "ignored_layers": ["lm_head"]})
        assert (quant.scales, quant.scale_name, quant.block_size, quant.row_scales) == ("tensor", "weight_scale", (1, 128), True)


def compressed_tensors_config(**weights) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                                                "dynamic": False, **weights},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group},
            "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None, "quantization_status": "compressed"}


def test_compressed_tensors_configs_are_read():
    quant = parse_quantization_config(compressed_tensors_config())
    assert (quant.scales, quant.scale_name, quant.row_scales) == ("channel", "weight_scale", True)
    assert not quant.converts("lm_head") and not quant.converts("model.layers.3.mlp.gate")
    assert quant.converts("model.layers.3.mlp.gate_proj") and quant.converts("model.lm_head_extra")
    assert parse_quantization_config(compressed_tensors_config(strategy="TENSOR", type="FLOAT")).scales == "tensor"
    block = parse_quantization_config(compressed_tensors_config(strategy="block", block_structure=[128, 128]))
    assert (block.scales, block.block_size, block.scale_name, block.row_scales) == ("block", (128, 128), "weight_scale", False)
    assert parse_quantization_config(compressed_tensors_config(strategy="block", block_structure="16x32")).block_size == (16, 32)
    assert (block.ignore_key, block.block_key) == ("ignore", "config_groups.<group>.weights.block_structure")


def test_compressed_tensors_ignore_matches_as_compressed_tensors_does():
    """compressed-tensors' ignore: a full module name, or "re:" and a pattern matched from the start (re.match), with
    none of transformers' module-boundary or suffix rules."""
    quant = parse_quantization_config({**compressed_tensors_config(),
                                       "ignore": ["lm_head", "re:.*self_attn.[qkv]", "re:.*layers.1", "re:mlp.down_proj"]})
    assert not quant.converts("lm_head") and quant.converts("model.lm_head")
    assert not quant.converts("model.layers.3.self_attn.k_proj") and quant.converts("model.layers.3.self_attn.o_proj")
    assert not quant.converts("model.layers.11.mlp.up_proj")  # re.match: layers.1 is a prefix of layers.11
    assert quant.converts("model.layers.3.mlp.down_proj")  # "mlp.down_proj" matches no name from its start


@pytest.mark.parametrize(
    "change,message",
    [
        ({"format": "pack-quantized"}, r"quantization_config\.format: 'pack-quantized' is not supported"),
        ({"kv_cache_scheme": {"num_bits": 8}}, r"quantization_config\.kv_cache_scheme: is not supported"),
        ({"sparsity_config": {"format": "sparse-24"}}, r"quantization_config\.sparsity_config: is not supported"),
        ({"config_groups": {}}, r"quantization_config\.config_groups: must hold exactly one group"),
        ({"weights": {"num_bits": 4, "type": "int"}}, r"config_groups\.group_0\.weights: must be 8-bit float"),
        ({"weights": {"strategy": "group", "group_size": 128}}, r"weights\.strategy: 'group' is not supported"),
        ({"weights": {"strategy": "block", "block_structure": None}}, r"weights\.block_structure: must be two positive"),
        ({"weights": {"symmetric": False}}, r"weights: must be symmetric"),
        ({"ignore": "lm_head"}, r"quantization_config\.ignore: must be a list"),
        ({"ignore": ["re:model.(("]}, r"quantization_config\.ignore: 're:model\.\(\(' is not a valid pattern"),
        ({"config_groups": {"FP8_DYNAMIC": ["Linear"]}}, r"config_groups\.FP8_DYNAMIC: must be an object"),
        ({"quantization_status": "frozen"}, r"quantization_status: 'frozen' is not supported"),
        ({"other": 1}, r"quantization_config\.other: is not supported"),
    ],
)
def test_unsupported_compressed_tensors_configs_name_the_key(change, message):
    weights = change.pop("weights", {})
    raw = {**compressed_tensors_config(**weights), **change}
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(raw)


@pytest.mark.parametrize("strategy,static", [("channel", False), ("tensor", True)], ids=["FP8_DYNAMIC", "FP8"])
def test_compressed_tensors_checkpoint_matches_transformers_at_tp_1_and_2(tiny_model_factory, tmp_path, strategy, static):
    """llm-compressor's FP8 checkpoints (per-channel scales with dynamic activations; per-tensor scales with a static
    input_scale, not read): tpserve against transformers on the dequantized weights, logits and greedy tokens."""
    from safetensors.torch import load_file

    fp8_dir = write_compressed_tensors_checkpoint(tiny_model_factory("qwen3"), str(tmp_path / "fp8"), strategy, static)
    ref_dir = write_dequantized(fp8_dir, str(tmp_path / "ref"))
    saved = load_file(os.path.join(fp8_dir, "model.safetensors"))
    scale = saved["model.layers.0.self_attn.k_proj.weight_scale"]
    assert saved["model.layers.0.self_attn.k_proj.weight"].dtype == FP8_DTYPE
    assert scale.shape == ((saved["model.layers.0.self_attn.k_proj.weight"].shape[0], 1) if strategy == "channel" else (1,))
    assert ("model.layers.0.mlp.down_proj.input_scale" in saved) == static
    engine = Engine(EngineConfig(model=fp8_dir, device="cpu", page_size=4))
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float32  # dequantized on the CPU
    assert f"scales per {strategy}" in engine._quantization_note()
    ids = list(range(30, 70))
    err = (teacher_forced_logits(engine, ids, prefill=9) - hf_logits(ref_dir, ids)[8 : len(ids) - 1]).abs().max().item()
    print(f"compressed-tensors {strategy}: max logit error {err:.2e}")
    assert err < 1e-4
    engine.shutdown()
    assert_greedy_matches_at_tp_1_and_2(fp8_dir, ref_dir)


def test_transformers_per_tensor_fp8_checkpoint(tiny_model_factory, tmp_path):
    """transformers' own per-tensor FP8 layout (weight_block_size null, activation_scheme static): a 0-d
    weight_scale_inv and an activation_scale per layer (not read)."""
    src = tiny_model_factory("qwen3")
    fp8_dir = write_compressed_tensors_checkpoint(src, str(tmp_path / "fp8"), "tensor")
    ref_dir = write_dequantized(fp8_dir, str(tmp_path / "ref"))
    path = os.path.join(fp8_dir, "model.safetensors")
    tensors = {}
    for name, tensor in load_file(path).items():
        if name.endswith(".weight_scale"):
            tensors[name + "_inv"] = tensor.float().reshape(())
            tensors[name.removesuffix("weight_scale") + "activation_scale"] = torch.tensor(0.05)
        else:
            tensors[name] = tensor
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = json.loads(open(os.path.join(fp8_dir, "config.json")).read())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None,
                                  "modules_to_not_convert": ["lm_head"]}
    open(os.path.join(fp8_dir, "config.json"), "w").write(json.dumps(cfg))
    assert_greedy_matches_at_tp_1_and_2(fp8_dir, ref_dir)


@pytest.mark.parametrize("arch,strategy", [("qwen3_moe", "channel"), ("qwen2_moe", "tensor")])
def test_compressed_tensors_moe_checkpoint_matches_transformers(tiny_model_factory, tmp_path, arch, strategy):
    """llm-compressor's FP8 MoE checkpoints (RedHatAI's Qwen3-30B-A3B-FP8-dynamic layout: every expert projection and
    Qwen2-MoE's shared expert scaled per channel or tensor): on the CPU the experts dequantized at load (the GPU keeps
    them FP8: tests/gpu/test_fp8_gpu.py), greedy tokens equal to transformers on the dequantized weights at TP 1 and
    2, and with expert parallelism."""
    fp8_dir = write_compressed_tensors_checkpoint(tiny_model_factory(arch, num_layers=3), str(tmp_path / "fp8"), strategy)
    ref_dir = write_dequantized(fp8_dir, str(tmp_path / "ref"))
    assert load_file(os.path.join(fp8_dir, "model.safetensors"))["model.layers.1.mlp.experts.5.down_proj.weight"].dtype == FP8_DTYPE
    engine = Engine(EngineConfig(model=fp8_dir, device="cpu", max_total_tokens=64))
    assert engine.model.model.layers[1].mlp.experts.dequantized
    engine.shutdown()
    assert_greedy_matches_at_tp_1_and_2(fp8_dir, ref_dir)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(fp8_dir, tp_size=2, device="cpu", page_size=4, expert_parallel=True) as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(ref_dir, p, 12) for p in PROMPTS]


def test_quantization_compressed_tensors_names_the_checkpoint_format():
    """vLLM's --quantization compressed-tensors: accepted for such a checkpoint (as fp8 is), an error for another."""
    compressed = parse_quantization_config(compressed_tensors_config())
    qwen = parse_quantization_config(PUBLISHED)
    assert resolve_quantization("compressed-tensors", compressed) is compressed
    assert resolve_quantization("fp8", compressed) is compressed
    with pytest.raises(ValueError, match="the checkpoint is quantized with fp8; it cannot be served as compressed-tensors"):
        resolve_quantization("compressed-tensors", qwen)
    with pytest.raises(ValueError, match="quantization compressed-tensors reads a checkpoint saved so .* has no "
                       "quantization_config; fp8 quantizes it at load"):
        resolve_quantization("compressed-tensors", None)
    with pytest.raises(ValueError, match="quantization must be one of fp8, compressed-tensors, got 'awq'"):
        resolve_quantization("awq", None)


def test_compressed_tensors_errors_name_the_checkpoint_tensors(tiny_model_factory, tmp_path):
    """A missing scale is named as the checkpoint names it (weight_scale); a scale of another shape is an error, for
    a linear layer and for an expert."""
    src = tiny_model_factory("qwen3")
    fp8_dir = write_compressed_tensors_checkpoint(src, str(tmp_path / "fp8"), "channel")
    path = os.path.join(fp8_dir, "model.safetensors")
    tensors = load_file(path)
    scale = tensors.pop("model.layers.1.mlp.up_proj.weight_scale")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing from the checkpoint: model\.layers\.1\.mlp\.up_proj\.weight_scale$"):
        Engine(EngineConfig(model=fp8_dir, device="cpu", max_total_tokens=64))
    tensors["model.layers.1.mlp.up_proj.weight_scale"] = scale[:, 0].reshape(2, -1)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight_scale' .* one scale per output row"):
        Engine(EngineConfig(model=fp8_dir, device="cpu", max_total_tokens=64))
    moe_dir = write_compressed_tensors_checkpoint(tiny_model_factory("qwen3_moe", num_layers=3), str(tmp_path / "moe"), "channel")
    path = os.path.join(moe_dir, "model.safetensors")
    tensors = load_file(path)
    down = "model.layers.1.mlp.experts.3.down_proj.weight_scale"
    tensors[down] = tensors[down][:-1]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight_scale' .* expected one "
                       r"scale per output row \(64, or \[64, 1\]\)"):
        Engine(EngineConfig(model=moe_dir, device="cpu", max_total_tokens=64))


def test_modules_to_not_convert_match_as_transformers_does():
    quant = QuantConfig("fp8", (128, 128), True, ("lm_head", "model.layers.1", r"model.layers.\d+.mlp.gate", "down_proj"))
    assert not quant.converts("lm_head")
    assert not quant.converts("model.layers.1.self_attn.q_proj")
    assert quant.converts("model.layers.11.self_attn.q_proj")  # prefix only at a module boundary
    assert not quant.converts("model.layers.3.mlp.gate")
    assert quant.converts("model.layers.3.mlp.gate_proj")
    assert not quant.converts("model.layers.3.mlp.down_proj")  # suffix


@pytest.mark.parametrize("block", [(128, 128), (16, 48), (1, 7)])
def test_block_quantization_round_trip(block):
    weight = torch.randn(100, 150, generator=torch.Generator().manual_seed(0))
    weight[:16] *= 100  # blocks with very different ranges keep their own precision
    weight[20:40, :] = 0.0
    q, scale = quantize_blocks(weight, block)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert scale.shape == (-(-100 // block[0]), -(-150 // block[1]))
    assert q.float().abs().max() <= FP8_MAX
    back = dequantize_blocks(q, scale, block, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each block's largest element
    err = (back - weight).abs()
    bound = dequantize_blocks(torch.ones_like(q), scale, block, torch.float32) * FP8_MAX / 16
    assert bool((err <= bound + 1e-30).all())
    assert torch.equal(back[20:40], torch.zeros(20, 150))


def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(fp8_pair):
    fp8_dir, ref_dir = fp8_pair((16, 32))  # non-square blocks
    with open(os.path.join(fp8_dir, "config.json")) as f:
        assert json.load(f)["quantization_config"] == {**PUBLISHED, "weight_block_size": [16, 32], "modules_to_not_convert": ["lm_head"]}
    engine = Engine(EngineConfig(model=fp8_dir, device="cpu", page_size=4))
    ids = list(range(30, 70))
    ours = teacher_forced_logits(engine, ids, prefill=9)
    ref = hf_logits(ref_dir, ids)[8 : len(ids) - 1]
    err = (ours - ref).abs().max().item()
    print(f"fp8 checkpoint (block 16x32) vs transformers on the dequantized weights: max logit error {err:.2e}")
    assert err < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(fp8_dir, device="cpu", page_size=4) as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(ref_dir, p, 12) for p in PROMPTS]


def test_fp8_checkpoint_at_tp2_with_partial_blocks_at_tp1(fp8_pair):
    """TP 2 splits every sharded dim into whole 16-blocks; a 48-wide input block leaves partial
    blocks at the edges at TP 1 (inputs are not split there)."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fp8_dir, ref_dir = fp8_pair((16, 16), ("lm_head", "model.layers.1.mlp"))
    with LLM(fp8_dir, tp_size=2, device="cpu", page_size=8) as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(ref_dir, p, 12) for p in PROMPTS]
    fp8_dir, ref_dir = fp8_pair((16, 48))
    with LLM(fp8_dir, device="cpu", page_size=8) as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(ref_dir, p, 12) for p in PROMPTS]


def test_unconverted_modules_load_unquantized(fp8_pair):
    fp8_dir, ref_dir = fp8_pair((16, 16), ("lm_head", "model.layers.1.mlp"))
    from safetensors.torch import load_file

    saved = load_file(os.path.join(fp8_dir, "model.safetensors"))
    assert saved["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.1.mlp.down_proj.weight_scale_inv" not in saved
    assert saved["model.layers.0.mlp.down_proj.weight"].dtype == FP8_DTYPE
    engine = Engine(EngineConfig(model=fp8_dir, device="cpu", max_total_tokens=64))
    ref = load_file(os.path.join(ref_dir, "model.safetensors"))
    params = dict(engine.model.named_parameters())
    assert torch.equal(params["model.layers.0.mlp.down_proj.weight"], ref["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(params["model.layers.1.mlp.down_proj.weight"], ref["model.layers.1.mlp.down_proj.weight"])
    assert not any(name.endswith("weight_scale_inv") for name in params), "the CPU path dequantizes at load"


def test_tp_shard_inside_a_block_is_an_error_naming_the_sizes(fp8_pair):
    fp8_dir, _ = fp8_pair((32, 32))  # 2 KV heads of 16: a TP-2 rank holds 16 rows of a 32-block
    config = ModelConfig.from_pretrained(fp8_dir)
    check_can_start(EngineConfig(model=fp8_dir, device="cpu"), config)
    with pytest.raises(ValueError, match=r"--tp-size 2: each rank's share of the key/value output features is 16, "
                       r"not a multiple of the FP8 weight block 32 \(quantization_config.weight_block_size \[32, 32\]\)"):
        check_can_start(EngineConfig(model=fp8_dir, device="cpu", tp_size=2), config, cli=True)
    with pytest.raises(ValueError, match=r"part is 16 of 32 features \(at offset 16.*cuts a quantization block of 32"):
        Slice(16, 16, 0, 32).blocks(32, "weight_scale_inv")
    assert Slice(32, 48, 64, 80).blocks(32, "w") == Slice(1, 2, 2, 3)  # the last block may be partial


def test_fp8_weights_without_quantization_config_are_an_error(fp8_pair, tmp_path):
    import shutil

    fp8_dir, _ = fp8_pair((16, 16))
    bad = shutil.copytree(fp8_dir, tmp_path / "m")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.self_attn.k_proj"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"keeps model\.layers\.0\.self_attn\.k_proj unquantized but not the rest"):
        Engine(EngineConfig(model=str(bad), device="cpu", max_total_tokens=64))
    del cfg["quantization_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.down_proj.weight' is float8_e4m3fn, but tpserve "
                       "holds it in float32 \\(config.json has no quantization_config"):
        Engine(EngineConfig(model=str(bad), device="cpu", max_total_tokens=64))


def edited_checkpoint(src: str, dst, edit) -> str:
    """A copy of the checkpoint at ``src`` whose tensors ``edit`` (a dict -> None) changes."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


O_PROJ = "model.layers.0.self_attn.o_proj.weight"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update({O_PROJ: t[O_PROJ].float().to(torch.float8_e5m2)}),
     rf"tensor '{O_PROJ}' is float8_e5m2, but config.json's quantization_config \(fmt e4m3\) makes it float8_e4m3fn"),
    (lambda t: t.update({O_PROJ: t[O_PROJ].float().to(torch.bfloat16)}),
     rf"tensor '{O_PROJ}' is bfloat16, but .* makes it float8_e4m3fn: list its module in modules_to_not_convert"),
    (lambda t: t.update({O_PROJ + "_scale_inv": torch.tensor(0.02)}),
     rf"tensor '{O_PROJ}_scale_inv' of shape \(\) does not fit .* expected 2 dimensions"),
], ids=["e5m2", "bf16", "per-tensor-scale"])
def test_malformed_fp8_tensors_are_errors_naming_them(fp8_pair, tmp_path, edit, message):
    """Each loaded before, silently: converted by the copy (wrong tokens), or an IndexError deep in the loader."""
    fp8_dir, _ = fp8_pair((16, 16))
    bad = edited_checkpoint(fp8_dir, tmp_path / "m", edit)
    with pytest.raises(ValueError, match=message):
        Engine(EngineConfig(model=bad, device="cpu", max_total_tokens=64))


def test_dummy_fp8_weights(fp8_pair):
    fp8_dir, _ = fp8_pair((16, 16))
    engine = Engine(EngineConfig(model=fp8_dir, device="cpu", load_format="dummy", max_total_tokens=64))
    weight = dict(engine.model.named_parameters())["model.layers.0.mlp.gate_up_proj.weight"]
    assert weight.dtype == torch.float32 and 0.01 < weight.std().item() < 0.03


@pytest.fixture(scope="module")
def fp8_moe(tiny_model_factory, tmp_path_factory):
    """make(**model kwargs) -> (fp8 dir, dequantized dir) of a tiny Qwen3-MoE (8 experts, top 2, layer 0
    dense) in the published per-expert format with 16x16 blocks, cached."""
    made: dict = {}

    def make(arch: str = "qwen3_moe", **kwargs) -> tuple[str, str]:
        key = (arch, *sorted(kwargs.items()))
        if key not in made:
            root = tmp_path_factory.mktemp("fp8-moe")
            fp8 = write_fp8_checkpoint(tiny_model_factory(arch, num_layers=3, **kwargs), str(root / "fp8"), (16, 16))
            made[key] = fp8, write_dequantized(fp8, str(root / "ref"))
        return made[key]

    return make


def test_fp8_moe_checkpoint_matches_transformers_at_tp_1_and_2(fp8_moe):
    """The published FP8 format of a MoE model (Qwen3-30B-A3B-FP8's): every expert's gate/up/down in
    float8_e4m3fn with its block scales, the router in bf16. Dequantized at load (the MoE kernels take
    compute-dtype experts), its logits are transformers' on the dequantized weights."""
    from safetensors.torch import load_file

    fp8_dir, ref_dir = fp8_moe()
    saved = load_file(os.path.join(fp8_dir, "model.safetensors"))
    assert saved["model.layers.1.mlp.experts.7.down_proj.weight"].dtype == FP8_DTYPE
    assert saved["model.layers.1.mlp.experts.7.gate_proj.weight_scale_inv"].shape == (2, 4)  # 32 x 64
    assert saved["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    engine = Engine(EngineConfig(model=fp8_dir, device="cpu", page_size=4))
    experts = engine.model.model.layers[1].mlp.experts
    assert experts.dequantized and experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj_scale_inv is None
    assert "experts dequantized to float32" in engine._quantization_note()
    ids = list(range(30, 70))
    ours = teacher_forced_logits(engine, ids, prefill=9)
    ref = hf_logits(ref_dir, ids)[8 : len(ids) - 1]
    err = (ours - ref).abs().max().item()
    print(f"fp8 MoE checkpoint (block 16x16) vs transformers on the dequantized weights: max logit error {err:.2e}")
    assert err < 5e-4  # float32 over logits up to ~8, the experts summed in another order (1.1e-4 measured)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert_greedy_matches_at_tp_1_and_2(fp8_dir, ref_dir)


@pytest.mark.parametrize("arch,quantized", [
    ("qwen2_moe", "model.layers.1.mlp.shared_expert.down_proj.weight"),  # the shared expert FP8, its gate bf16
    ("mixtral", "model.layers.2.block_sparse_moe.experts.7.w2.weight"),
])
def test_fp8_moe_architectures_match_transformers_at_tp_1_and_2(fp8_moe, arch, quantized):
    """Qwen2-MoE's and Mixtral's FP8 checkpoints in the published block format against transformers on the
    dequantized weights: greedy tokens at TP 1 and 2."""
    from safetensors.torch import load_file

    fp8_dir, ref_dir = fp8_moe(arch)
    saved = load_file(os.path.join(fp8_dir, "model.safetensors"))
    assert saved[quantized].dtype == FP8_DTYPE and quantized + "_scale_inv" in saved
    assert_greedy_matches_at_tp_1_and_2(fp8_dir, ref_dir)


@pytest.mark.parametrize("pattern", [r"model\.layers\.\d+\.block_sparse_moe\.experts", r"model\.layers\.\d+\.mlp\.experts"])
def test_mixtral_experts_left_unconverted_in_either_spelling(tiny_model_factory, tmp_path, pattern):
    """modules_to_not_convert may name Mixtral's experts as its checkpoints do or as transformers' modules do (it reads
    both): the experts stay bf16, and TP 2 may cut their 48 rows inside a 16-block, since no block is cut."""
    src = tiny_model_factory("mixtral", num_layers=3, moe_intermediate_size=48)
    mixtral_experts = r"model\.layers\.\d+\.block_sparse_moe\.experts"  # the helper matches the checkpoint's names
    fp8_dir = write_fp8_checkpoint(src, str(tmp_path / "fp8"), (16, 16), ("lm_head", mixtral_experts))
    cfg = json.loads(open(os.path.join(fp8_dir, "config.json")).read())
    cfg["quantization_config"]["modules_to_not_convert"] = ["lm_head", pattern]
    open(os.path.join(fp8_dir, "config.json"), "w").write(json.dumps(cfg))
    ref_dir = write_dequantized(fp8_dir, str(tmp_path / "ref"))
    assert_greedy_matches_at_tp_1_and_2(fp8_dir, ref_dir)


def test_expert_tensors_of_another_width_are_errors_naming_them(fp8_moe, tmp_path):
    """An expert's tensor is cut to this rank's rows: one of another size than config.json says was cut to fit."""
    fp8_dir, _ = fp8_moe()
    down = "model.layers.1.mlp.experts.5.down_proj.weight"
    bad = edited_checkpoint(fp8_dir, tmp_path / "scale", lambda t: t.update(
        {down + "_scale_inv": torch.ones(t[down + "_scale_inv"].shape[0], t[down + "_scale_inv"].shape[1] + 1)}))
    with pytest.raises(ValueError, match=rf"tensor '{down}_scale_inv' of shape .* expected 2 dimensions with"):
        Engine(EngineConfig(model=bad, device="cpu", max_total_tokens=64))
    wide = edited_checkpoint(fp8_dir, tmp_path / "wide", lambda t: t.update(
        {down: torch.cat([t[down], t[down]], dim=1)}))
    with pytest.raises(ValueError, match=rf"tensor '{down}' of shape .* expected 2 dimensions with \d+ along dim 1"):
        Engine(EngineConfig(model=wide, device="cpu", max_total_tokens=64))


def test_one_expert_kept_unquantized_is_an_error(fp8_moe, tmp_path):
    fp8_dir, _ = fp8_moe()
    bad = edited_checkpoint(fp8_dir, tmp_path / "m", lambda t: None)
    cfg = json.loads(open(os.path.join(bad, "config.json")).read())
    cfg["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.1.mlp.experts.3"]
    open(os.path.join(bad, "config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"keeps expert\(s\) \[3\] of model.layers.1.mlp.experts unquantized but not"):
        Engine(EngineConfig(model=bad, device="cpu", max_total_tokens=64))


def test_fp8_moe_experts_cut_inside_a_block_is_an_error(fp8_moe):
    fp8_dir, _ = fp8_moe(moe_intermediate_size=48)  # TP 2: 24 of every expert's 48 rows, inside a 16-block
    config = ModelConfig.from_pretrained(fp8_dir)
    with pytest.raises(ValueError, match=r"--tp-size 2: each rank's share of the expert gate/up output features "
                       r"\(moe_intermediate_size\) is 24, not a multiple of the FP8 weight block 16.*"
                       r"expert parallelism \(--expert-parallel\) keeps experts whole"):
        check_can_start(EngineConfig(model=fp8_dir, device="cpu", tp_size=2), config, cli=True)
    engine = Engine(EngineConfig(model=fp8_dir, device="cpu", load_format="dummy", max_total_tokens=64))
    assert engine.model.model.layers[1].mlp.experts.gate_up_proj.std().item() > 0.01  # dummy FP8 experts, scaled


def test_fp8_moe_expert_parallel_serves_a_width_tp_would_cut_inside_a_block(fp8_moe):
    """Qwen3-30B-A3B-FP8 at TP 4 in small: TP 2 would cut every expert's 48 rows inside a 16-block; expert
    parallelism keeps 4 whole experts (and their block scales) on each rank."""
    fp8_dir, ref_dir = fp8_moe(moe_intermediate_size=48)
    check_can_start(EngineConfig(model=fp8_dir, device="cpu", tp_size=2, expert_parallel=True),
                    ModelConfig.from_pretrained(fp8_dir), cli=True)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(fp8_dir, tp_size=2, device="cpu", page_size=4, expert_parallel=True) as llm:
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(ref_dir, p, 12) for p in PROMPTS]
