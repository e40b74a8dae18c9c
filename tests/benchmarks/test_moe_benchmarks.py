"""The GPU suite's Qwen3-MoE benchmarks on a tiny MoE model on the CPU: they run, and their floors
count only the experts a step reads (the figures mean nothing on a shared CPU)."""

from __future__ import annotations

import json

import pytest
from test_step_trace import BENCHMARKS, run

from tpserve.engine_config import EngineConfig
from tpserve.engine.engine import Engine


@pytest.fixture(scope="module")
def moe_model(tiny_model_factory) -> str:
    # 8 experts, top 2, layer 0 dense; the workload's token ids reach 10,000
    return tiny_model_factory("qwen3_moe", vocab_size=10_240)


def test_offline_throughput_traced_and_its_roofline(moe_model, tmp_path):
    out = str(tmp_path / "trace.json")
    printed = run(
        "offline_throughput.py", "--model", moe_model, "--num-requests", "4", "--max-input-len", "24",
        "--max-output-len", "6", "--dtype", "float32", "--trace", "--out", out,
    )
    assert "Step trace" in printed
    with open(out) as f:
        assert json.load(f)["output_tokens"] == 4 * 6
    printed = run("roofline.py", out, "--model", moe_model, "--peak-tflops", "1", "--bandwidth-tbps", "0.001")
    assert "ceilings of the workload" in printed


def test_decode_latency_runs_the_moe_model(moe_model, tmp_path):
    out = str(tmp_path / "decode.json")
    run("decode_latency.py", "--model", moe_model, "--batch-sizes", "1,3", "--contexts", "8", "--modes", "eager,pipelined",
        "--warmup", "1", "--iters", "2", "--out", out)
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert [r["batch"] for r in rows] == [1, 3] and all(r["eager_ms"] > 0 and r["pipelined_ms"] > 0 for r in rows)


def test_decode_floor_reads_the_routed_experts(moe_model, monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    from common import expert_bytes, weight_bytes_per_decode_step
    from step_trace import FloorModel

    engine = Engine(EngineConfig(model=moe_model, device="cpu", dtype="float32"))
    moe = engine.model_config.moe
    assert moe is not None and (moe.num_experts, moe.top_k) == (8, 2)
    experts = expert_bytes(engine)
    everything = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    embed = engine.model.model.embed_tokens.weight
    dense = everything - experts - embed.numel() * embed.element_size()
    row = embed.shape[1] * embed.element_size()
    # One token reads 2 of 8 experts a layer; 1,000 tokens about all of them.
    assert weight_bytes_per_decode_step(engine, 1) == pytest.approx(dense + experts * 2 / 8 + row)
    assert weight_bytes_per_decode_step(engine, 1000) == pytest.approx(dense + experts + 1000 * row)
    floor = FloorModel.from_engine(engine, bandwidth=1e9)
    assert floor is not None
    for batch in (1, 5, 64):
        assert floor.ms(batch, 0) == pytest.approx(weight_bytes_per_decode_step(engine, batch) / 1e9 * 1e3)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_roofline_counts_every_linear_weight(tiny_model_factory, arch, monkeypatch):
    """The roofline's weights (what every step reads, and each expert's) add up to the model's linear weights as the
    planner counts them from the built layers: Qwen2-MoE's shared expert and its gate are read by every step."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    from roofline import model_numbers

    from tpserve.config import ModelConfig
    from tpserve.plan.cost import ModelShape

    model_dir = tiny_model_factory(arch, num_layers=3)
    numbers = model_numbers(model_dir)
    every_expert = numbers.moe_layers * numbers.num_experts * numbers.expert_weights
    assert numbers.shared_weights + every_expert == ModelShape(ModelConfig.from_pretrained(model_dir), 2).layers_linear_params()
