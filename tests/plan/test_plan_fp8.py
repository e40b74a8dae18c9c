"""The planner counts FP8 weights: an FP8 checkpoint's quantization_config, or --quantization fp8, on
a GPU (the CPU engine dequantizes them, so there they count in the serving dtype)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from plan_configs import data_config, write_config

from tpserve.config import ModelConfig
from tpserve.plan.cli import main
from tpserve.plan.cost import ModelShape

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def qwen3_8b() -> dict:
    with open(os.path.join(data_config("Qwen3-8B"), "config.json")) as f:
        return json.load(f)


def test_fp8_linear_weights_are_one_byte_plus_block_scales():
    cfg = ModelConfig.from_dict(qwen3_8b())
    bf16, fp8 = ModelShape(cfg, 2), ModelShape(cfg, 2, (128, 128))
    linear = bf16.layers_linear_params(1)
    rest = bf16.params_per_rank(1) - linear
    assert fp8.linear_bytes == 1 + 4 / 128**2
    assert fp8.weight_bytes_per_rank(1) == pytest.approx(linear * (1 + 4 / 128**2) + 2 * rest)
    assert bf16.weight_bytes_per_rank(1) - fp8.weight_bytes_per_rank(1) == pytest.approx(linear * (1 - 4 / 128**2))
    # Qwen3-8B: 6.95 B linear weights of 8.19 B; about 16.4 GB in bf16, 9.5 GB with FP8 linears
    assert fp8.weight_bytes_per_rank(1) / 1e9 == pytest.approx(9.45, abs=0.1)
    assert fp8.weight_bytes_per_rank(2) == pytest.approx(
        bf16.layers_linear_params(2) * fp8.linear_bytes + 2 * (bf16.params_per_rank(2) - bf16.layers_linear_params(2))
    )
    for batch in (1, 64):
        saved = bf16.decode_read_bytes(1, batch) - fp8.decode_read_bytes(1, batch)
        assert saved == pytest.approx(linear * (1 - 4 / 128**2))


def weights_gib(out: str) -> float:
    line = next(line for line in out.splitlines() if line.startswith("model "))
    return float(line.split(" B parameters, ")[1].split(" GiB")[0])


def test_cli_counts_fp8_checkpoints_and_quantization_flag(tmp_path, capsys):
    plain = write_config(str(tmp_path / "bf16"), qwen3_8b())
    fp8 = write_config(str(tmp_path / "fp8"), {**qwen3_8b(), "quantization_config": FP8_CONFIG})
    results = {}
    for name, argv in {
        "bf16": ["--model", plain],
        "asked": ["--model", plain, "--quantization", "fp8"],
        "checkpoint": ["--model", fp8],
        "cpu": ["--model", fp8, "--gpu", "cpu"],
    }.items():
        assert main([*argv, "--context", "4096"]) == 0
        results[name] = capsys.readouterr().out
    gib = {name: weights_gib(out) for name, out in results.items()}
    assert gib["bf16"] == pytest.approx(15.3, abs=0.1)
    assert gib["asked"] == gib["checkpoint"] == pytest.approx(8.8, abs=0.1)
    assert gib["cpu"] > gib["bf16"]  # float32 on the CPU, dequantized
    assert "decoder linears FP8" in results["asked"] and "scale per 128x128 block" in results["checkpoint"]
    assert "--quantization fp8" in results["asked"] and "--quantization" not in results["checkpoint"]
    # fewer weight bytes: a faster batch-1 step (bound by the bytes it reads)
    step = {name: float(out.split("batch-1 step ")[1].split(" ms")[0]) for name, out in results.items()}
    assert step["asked"] == step["checkpoint"] < 0.7 * step["bf16"]


def test_moe_fp8_checkpoint_and_quantization_flag_count_fp8_experts(capsys):
    """An FP8 MoE checkpoint keeps its experts FP8 on the GPU (routers in the serving dtype), and --quantization fp8
    quantizes them at load into the same layout, as the engine does. Qwen3-30B-A3B: 56.9 GiB of bf16 weights, 29.0
    with FP8 experts."""
    results = {}
    for name, argv in {
        "bf16": ["--model", data_config("Qwen3-30B-A3B")],
        "asked": ["--model", data_config("Qwen3-30B-A3B"), "--quantization", "fp8"],
        "checkpoint": ["--model", data_config("Qwen3-30B-A3B-FP8")],
    }.items():
        assert main([*argv, "--context", "4096"]) == 0
        results[name] = capsys.readouterr().out
    gib = {name: weights_gib(out) for name, out in results.items()}
    assert gib["bf16"] == pytest.approx(56.9, abs=0.3)
    assert gib["checkpoint"] == gib["asked"] == pytest.approx(29.0, abs=0.2)  # 31.2 GB
    assert "experts too" in results["asked"] and "experts too" in results["checkpoint"]
    shape = ModelShape(ModelConfig.from_pretrained(data_config("Qwen3-30B-A3B-FP8")), 2, (128, 128), fp8_experts=True)
    experts, routers = shape.sparse_layer_params(1)
    assert routers == 48 * 128 * 2048 and experts == 48 * 128 * 3 * 2048 * 768
    assert shape.linear_weight_bytes(1) == pytest.approx(
        (shape.layers_linear_params(1) - routers) * shape.linear_bytes + routers * 2)


def test_moe_checkpoint_scaled_per_channel_counts_its_experts_fp8_with_a_scale_a_row(tmp_path, capsys):
    """A compressed-tensors FP8 MoE checkpoint scaled per channel (RedHatAI's Qwen3-30B-A3B-FP8-dynamic layout): the
    engine keeps its experts FP8 with one float32 scale per expert row, so the plan counts them so, and the attention
    in FP8 with a scale a row too (held as [rows, 1])."""
    import json

    cfg = json.load(open(os.path.join(data_config("Qwen3-30B-A3B"), "config.json")))
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                                "dynamic": False}}
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                  "config_groups": {"group_0": group}, "ignore": ["lm_head", "re:.*mlp.gate$"]}
    channel = write_config(str(tmp_path / "channel"), cfg)
    results = {}
    for name, model in (("bf16", data_config("Qwen3-30B-A3B")), ("channel", channel)):
        assert main(["--model", model, "--context", "4096"]) == 0
        results[name] = weights_gib(capsys.readouterr().out)
    # the attention halved (0.84 GiB) and the experts' 29.0e9 weights from 2 bytes to 1, less their 88 MB of scales
    assert results["bf16"] - results["channel"] == pytest.approx(0.84 + 29.0e9 / 2**30 - 0.088e9 / 2**30, abs=0.1)
    shape = ModelShape(ModelConfig.from_dict(cfg), 2, (1, 128), fp8_experts=True, fp8_row_scales=True)
    assert shape.expert_bytes() == pytest.approx(1 + 4 * (2 * 768 + 2048) / (3 * 2048 * 768))
    # at TP 4 a rank holds 192 rows of each gate and up but all 2,048 of down (a row's scale is not cut)
    assert shape.expert_bytes(4) == pytest.approx(1 + 4 * (2 * 192 + 2048) / (3 * 2048 * 192))
    assert shape.linear_bytes == pytest.approx(1 + 4 / 2048)
    assert main(["--model", channel]) == 0
    assert "1 byte each and a float32 scale a row, experts too" in capsys.readouterr().out


def test_cli_quantization_errors(tmp_path, capsys):
    plain = write_config(str(tmp_path / "bf16"), qwen3_8b())
    assert main(["--model", plain, "--quantization", "int4"]) == 2
    assert "--quantization" in capsys.readouterr().err


def test_fp8_kv_cache_holds_twice_the_tokens_and_reads_half_the_bytes(tmp_path, capsys):
    from tpserve.plan.cost import GPUS
    from tpserve.plan.splits import Machine, Settings, plan_splits

    cfg = ModelConfig.from_dict(qwen3_8b())
    bf16_kv, fp8_kv = ModelShape(cfg, 2), ModelShape(cfg, 2, kv_dtype_bytes=1)
    for tp in (1, 2, 16):  # 16: KV heads replicated past their count
        assert fp8_kv.kv_bytes_per_token(tp) * 2 == bf16_kv.kv_bytes_per_token(tp)
    machine, settings = Machine(GPUS["h200"], 1), Settings(32768)
    (bf16_plan,), _ = plan_splits(bf16_kv, machine, settings)
    (fp8_plan,), _ = plan_splits(fp8_kv, machine, settings)
    assert fp8_plan.kv_tokens == pytest.approx(2 * bf16_plan.kv_tokens, rel=1e-3)
    assert fp8_plan.decode_max.seconds / fp8_plan.max_batch < bf16_plan.decode_max.seconds / bf16_plan.max_batch
    # Only Hopper reads FP8 pages faster (XQA); on an A100 the decode wrapper is as slow as bf16.
    from tpserve.plan.cost import decode_step

    for gpu, faster in ((GPUS["h200"], True), (GPUS["h100"], True), (GPUS["a100"], False)):
        fp8_step, bf16_step = (decode_step(s, gpu, 1, 64, 8192).seconds for s in (fp8_kv, bf16_kv))
        assert (fp8_step < 0.9 * bf16_step) == faster and fp8_step <= bf16_step

    plain = write_config(str(tmp_path / "bf16"), qwen3_8b())
    assert main(["--model", plain, "--context", "4096", "--kv-cache-dtype", "fp8_e4m3"]) == 0
    assert "--kv-cache-dtype fp8_e4m3" in capsys.readouterr().out  # the recommended command keeps it
    assert main(["--model", plain, "--kv-cache-dtype", "fp4"]) == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err


def test_moe_fp8_checkpoint_takes_expert_parallelism_where_tp_would_cut_its_blocks(capsys):
    """Qwen3-30B-A3B-FP8 at TP 4 and 8 would cut every expert's 768 rows into 192 and 96, inside the 128-blocks:
    the plan keeps those splits with whole experts per rank, costed with the busiest rank's experts, and launches
    them so."""
    from tpserve.plan.cost import GPUS
    from tpserve.plan.splits import Machine, Settings, evaluate, launch_commands, plan_splits

    shape = ModelShape(ModelConfig.from_pretrained(data_config("Qwen3-30B-A3B-FP8")), 2, (128, 128), fp8_experts=True)
    machine = Machine(GPUS["h200"], 8)
    plans, excluded = plan_splits(shape, machine, Settings(8192))
    assert [(p.tp, p.expert_parallel) for p in plans] == [(1, False), (2, False), (4, True), (8, True)]
    assert not excluded
    assert plans[2].weight_bytes_per_gpu == pytest.approx(shape.weight_bytes_per_rank(4))
    # a decode step waits for the rank whose experts the tokens chose most: at one token (8 of 128 experts) the
    # busiest of 4 ranks holds ~3.45 of them, not the 2 of an even share; at many tokens every expert is read anyway
    ep = dataclasses.replace(shape, expert_parallel=True)
    assert ep.touched_experts(1, 4) == pytest.approx(3.45, abs=0.01) and shape.touched_experts(1) / 4 == 2
    assert ep.touched_experts(512, 4) == pytest.approx(32) and ep.decode_read_bytes(4, 512) == pytest.approx(
        shape.decode_read_bytes(4, 512))
    assert ep.decode_read_bytes(4, 1) > 1.3 * shape.decode_read_bytes(4, 1)
    assert plans[2].decode_1.seconds > evaluate(shape, machine, 4, Settings(8192)).decode_1.seconds
    assert "--tp-size 4 --max-model-len 8192 --expert-parallel" in launch_commands(plans[2], "M", machine, Settings(8192))[0]
    assert main(["--model", data_config("Qwen3-30B-A3B-FP8"), "--gpus", "8", "--context", "8192"]) == 0
    assert "TP8 EP x DP1" in capsys.readouterr().out
