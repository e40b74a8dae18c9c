"""Splits, exclusions and recommendations on known cases."""

from __future__ import annotations

import pytest
from plan_configs import QWEN3_0_6B, QWEN3_235B_A22B, config, data_config

from tpserve.config import ModelConfig
from tpserve.plan.cost import GPUS, ModelShape
from tpserve.plan.splits import Machine, Settings, best_for_latency, best_for_throughput, plan_splits


def splits(cfg: ModelConfig, gpus: int, nodes: int = 1, context: int = 4096, gpu: str = "h200"):
    return plan_splits(ModelShape(cfg, 2), Machine(GPUS[gpu], gpus, nodes), Settings(context))


def test_small_model_on_8_gpus_is_data_parallel():
    plans, excluded = splits(config(QWEN3_0_6B), 8)
    assert [p.tp for p in plans] == [1, 2, 4, 8] and not excluded
    for best in (best_for_throughput(plans), best_for_latency(plans)):
        assert (best.tp, best.dp) == (1, 8)
    by_tp = {p.tp: p for p in plans}
    # DP multiplies throughput; TP adds all-reduces to steps already dominated by per-layer overheads
    assert by_tp[1].max_batch_tok_s > 1.2 * by_tp[8].max_batch_tok_s
    assert by_tp[8].decode_1.comm_share > 0.3


def test_moe_counts_every_expert_held_and_the_touched_ones_read():
    cfg = ModelConfig.from_pretrained(data_config("Qwen3-30B-A3B"))  # 48 sparse layers, 128 experts, top 8
    shape = ModelShape(cfg, 2)
    assert shape.params() == pytest.approx(30.5e9, rel=0.01)
    expert_bytes = 2 * 48 * shape.expert_params()
    # batch 1 reads its 8 experts per layer; batch 64 most of the 128 (uniform routing)
    assert shape.decode_read_bytes(1, 64) - shape.decode_read_bytes(1, 1) == pytest.approx(
        (shape.touched_experts(64) - 8) * expert_bytes, rel=1e-4  # and 63 more embedding rows
    )
    assert 8 < shape.touched_experts(64) < 128
    assert shape.decode_read_bytes(1, 1) < 0.15 * shape.weight_bytes_per_rank(1)
    # the FLOPs are the active ones: "A3B", 3.3 B weights per token with the embedding and LM head
    assert shape.linear_flops(1, 1, 1) / 2 + 151936 * 2048 == pytest.approx(3.3e9, rel=0.03)
    assert shape.weight_bytes_per_rank(4) < shape.weight_bytes_per_rank(1) / 3.5  # experts split by TP


def test_235b_in_bf16_does_not_fit_one_h200_but_fits_eight():
    cfg = config(QWEN3_235B_A22B)
    assert ModelShape(cfg, 2).params() == pytest.approx(235e9, rel=0.01)
    (one,), _ = splits(cfg, 1)
    assert not one.fits and one.kv_tokens == 0 and one.decode_1 is None
    assert best_for_latency([one]) is None and best_for_throughput([one]) is None
    plans, excluded = splits(cfg, 8)
    by_tp = {p.tp: p for p in plans}
    assert not by_tp[1].fits and not by_tp[2].fits and by_tp[4].fits and by_tp[8].fits
    assert best_for_throughput(plans).tp in (4, 8) and not excluded


def test_invalid_tp_sizes_are_excluded_with_their_reason():
    cfg = ModelConfig.from_pretrained(data_config("Qwen2.5-7B-Instruct"))  # 28 heads, 4 KV heads
    plans, excluded = splits(cfg, 8)
    assert [p.tp for p in plans] == [1, 2, 4]
    assert [(e.tp, e.reason) for e in excluded] == [(8, "tp 8 does not divide num_attention_heads 28")]
    _, excluded = splits(cfg, 6)
    assert {e.tp: e.reason for e in excluded} == {
        3: "tp 3 does not divide num_attention_heads 28",
        6: "tp 6 does not divide num_attention_heads 28",
    }


def test_tp_across_nodes_takes_whole_nodes_and_pays_the_network():
    cfg = ModelConfig.from_pretrained(data_config("Qwen3-8B"))
    plans, excluded = splits(cfg, 4, nodes=2)
    assert [(p.tp, p.dp) for p in plans] == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert excluded == []
    within, across = plans[2], plans[3]
    # Halving the weights per GPU does not pay for all-reduces over the network at batch 1.
    assert across.decode_1.comm_share > 0.5 > within.decode_1.comm_share
    assert across.decode_1.seconds > within.decode_1.seconds
    _, excluded = splits(ModelConfig.from_pretrained(data_config("Qwen3-32B")), 6, nodes=4)
    assert {e.tp: e.reason for e in excluded}[8] == "a TP group of 8 across nodes must take whole nodes of 6 GPUs"


def test_kv_capacity_and_batch_follow_memory_and_context():
    cfg = ModelConfig.from_pretrained(data_config("Qwen3-32B"))
    short, _ = splits(cfg, 2, context=4096, gpu="h100")
    long, _ = splits(cfg, 2, context=32768, gpu="h100")
    tp1, tp2 = short
    # 65.5 GB of weights leave little room on one 80 GiB H100; two share them and hold far more KV
    assert tp1.weight_bytes_per_gpu > 60e9 and tp2.kv_tokens > 5 * tp1.kv_tokens
    assert tp2.max_batch == min(256, tp2.requests_per_replica)
    assert long[1].requests_per_replica == tp2.kv_tokens // 32768 < tp2.requests_per_replica
    assert tp2.decode_1.seconds < tp1.decode_1.seconds  # TP halves the bytes a step reads
