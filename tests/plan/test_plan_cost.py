"""The cost model's arithmetic on seed 003's worked example (Llama-3-70B, TP 8 on H100s:
all-reduce 10 us + 360 GB/s bus, HBM 3.35 TB/s, 989 TFLOP/s at 50% MFU)."""

from __future__ import annotations

import pytest
from plan_configs import LLAMA_3_70B, QWEN3_0_6B, config, data_config

from tpserve.plan.cost import (
    GPUS, PREFILL_MFU, Link, ModelShape, all_reduce_seconds, decode_step, layers_all_reduce_seconds, prefill_seconds,
)

SEED_LINK = Link(alpha_s=10e-6, bus_bandwidth=360e9)
SEED_H100 = GPUS["h100"].__class__(
    "h100-seed", 80 * 2**30, 3.35e12, 989e12 * 0.5 / PREFILL_MFU, SEED_LINK, layer_overhead_s=0.0
)


@pytest.fixture(scope="module")
def llama70b() -> ModelShape:
    return ModelShape(config(LLAMA_3_70B), dtype_bytes=2)


def test_parameter_count(llama70b):
    assert llama70b.params() == pytest.approx(70.55e9, rel=1e-3)
    assert llama70b.weight_bytes_per_rank(8) == pytest.approx(70.55e9 * 2 / 8, rel=1e-3)


def test_olmoe_layers_all_reduce_their_q_k_norm_sums_too():
    """OLMoE's q/k RMSNorms span every head: a third all-reduce a layer, of 2 float32 sums a token."""
    from tpserve.config import ModelConfig

    olmoe = ModelShape(ModelConfig.from_pretrained(data_config("OLMoE-1B-7B-0924")), dtype_bytes=2)
    per_layer = 2 * all_reduce_seconds(64 * 2048 * 2, 2, SEED_LINK) + all_reduce_seconds(64 * 2 * 4, 2, SEED_LINK)
    assert layers_all_reduce_seconds(olmoe, 64, 2, SEED_LINK) == pytest.approx(16 * per_layer)
    assert layers_all_reduce_seconds(olmoe, 64, 1, SEED_LINK) == 0.0


def test_decode_batch_64_communication_and_weight_floor(llama70b):
    # seed: "decode (batch 64): communication about 2.4 ms, weight-read floor 5.3 ms"
    assert round(layers_all_reduce_seconds(llama70b, 64, 8, SEED_LINK) * 1e3, 1) == 2.4
    assert round(llama70b.weight_bytes_per_rank(8) / 3.35e12 * 1e3, 1) == 5.3
    # a step also all-reduces the embedding and gathers the logits, and reads no embedding table
    step = decode_step(llama70b, SEED_H100, 8, 64, 1)
    assert step.comm_seconds == pytest.approx(2.4e-3, rel=0.05)
    assert llama70b.decode_read_bytes(8, 64) / 3.35e12 == pytest.approx(5.3e-3, rel=0.03)


def test_prefill_4096_communication_and_compute(llama70b):
    # seed: "prefill (4096 tokens): communication about 54 ms, compute about 146 ms"
    assert round(layers_all_reduce_seconds(llama70b, 4096, 8, SEED_LINK) * 1e3) == 54
    prefill = prefill_seconds(llama70b, SEED_H100, 8, 4096)
    assert round(prefill.comm_seconds * 1e3) == 54
    # the seed counts 2 FLOPs per parameter per token; the planner adds causal attention and
    # runs the LM head on the last token only: within 2%
    assert prefill.seconds - prefill.comm_seconds == pytest.approx(0.146, rel=0.02)
    assert 0.25 < prefill.comm_share < 0.3


def test_ring_all_reduce_formula():
    assert all_reduce_seconds(1e6, 1, SEED_LINK) == 0.0
    assert all_reduce_seconds(1e6, 2, SEED_LINK) == pytest.approx(10e-6 + 1e6 / 360e9)
    assert all_reduce_seconds(1e6, 8, SEED_LINK) == pytest.approx(10e-6 + 1.75e6 / 360e9)


def test_kv_heads_replicate_past_their_count():
    shape = ModelShape(config(QWEN3_0_6B), dtype_bytes=2)  # 8 KV heads
    assert shape.kv_bytes_per_token(1) == 2 * 28 * 8 * 128 * 2
    assert shape.kv_bytes_per_token(8) == shape.kv_bytes_per_token(1) / 8
    assert shape.kv_heads_per_rank(16) == 1  # replicated: the total KV grows


def test_decode_is_bandwidth_bound_and_grows_with_batch_and_context():
    shape = ModelShape(config(QWEN3_0_6B), dtype_bytes=2)
    gpu = GPUS["h200"]
    one, many, long = (decode_step(shape, gpu, 1, b, c) for b, c in ((1, 512), (64, 512), (64, 8192)))
    assert one.seconds < many.seconds < long.seconds
    assert one.comm_seconds == 0.0
    assert decode_step(shape, gpu, 2, 1, 512).comm_share > 0


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
@pytest.mark.parametrize("tp,expert_parallel", [(1, False), (2, False), (2, True)])
def test_parameter_count_is_the_models(tiny_model_factory, arch, tp, expert_parallel):
    """The cost model counts a rank's parameters as tpserve's layers hold them: routers, experts (sliced or whole) and
    Qwen2-MoE's shared expert and its gate. The model is built on the meta device as each rank builds it."""
    import torch

    from tpserve.config import ModelConfig
    from tpserve.distributed.comm import SingleRankCommunicator
    from tpserve.distributed.info import set_tp_info
    from tpserve.models.decoder import CausalLM

    cfg = ModelConfig.from_pretrained(tiny_model_factory(arch, num_layers=3))
    set_tp_info(0, tp, expert_parallel)
    try:
        with torch.device("meta"):
            model = CausalLM(cfg, SingleRankCommunicator(), 64)
    finally:
        set_tp_info(0, 1)
    held = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    padded_vocab = ModelShape(cfg, 2).vocab_rows(tp) * tp - cfg.vocab_size  # the last rank's zero rows
    assert padded_vocab == 0
    assert ModelShape(cfg, 2, expert_parallel=expert_parallel).params_per_rank(tp) == held
