"""Invalid tensor-parallel sizes get errors that name the numbers."""

import pytest

from tpserve.config import ModelConfig
from tpserve.distributed.info import set_tp_info
from tpserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear


def config(heads=4, kv_heads=2, intermediate=128) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": intermediate,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
        }
    )


@pytest.mark.parametrize(
    "tp,kwargs,message",
    [
        (3, {}, "tp_size 3 does not divide num_attention_heads 4"),
        (2, {"heads": 6, "kv_heads": 3}, "num_key_value_heads 3 neither divides nor is divided by tp_size 2"),
        (4, {"heads": 12, "kv_heads": 3, "intermediate": 128}, "num_key_value_heads 3 neither divides"),
        (2, {"intermediate": 129}, "tp_size 2 does not divide intermediate_size 129"),
    ],
)
def test_check_tp_size_errors(tp, kwargs, message):
    with pytest.raises(ValueError, match=message):
        config(**kwargs).check_tp_size(tp)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_valid_tp_sizes(tp):
    config(heads=8, kv_heads=2, intermediate=256).check_tp_size(tp)


def test_layers_raise_too():
    set_tp_info(0, 3)
    with pytest.raises(ValueError, match="tp_size 3 does not divide num_attention_heads 4"):
        QKVParallelLinear(64, 16, 4, 2, bias=False)
    with pytest.raises(ValueError, match="tp_size 3 does not divide intermediate_size 128"):
        MergedColumnParallelLinear(64, [128, 128])
    set_tp_info(0, 1)


def test_kv_head_replication_layout():
    # 2 KV heads over 4 ranks: ranks 0,1 keep head 0; ranks 2,3 keep head 1.
    starts = []
    for rank in range(4):
        set_tp_info(rank, 4)
        layer = QKVParallelLinear(64, 16, 4, 2, bias=False)
        assert layer.num_heads == 1 and layer.num_kv_heads == 1
        starts.append(layer.kv_head_start)
    assert starts == [0, 0, 1, 1]
    set_tp_info(0, 1)
