"""A row-parallel layer hands back its partial sum when its caller all-reduces it (fused with the
next add+RMSNorm), and refuses to where its bias would be added on every rank."""

import pytest
import torch

from tpserve.distributed.comm import SingleRankCommunicator
from tpserve.distributed.info import set_tp_info
from tpserve.layers.linear import RowParallelLinear


class _Doubling(SingleRankCommunicator):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _layer(bias: bool) -> RowParallelLinear:
    set_tp_info(0, 1)
    layer = RowParallelLinear(4, 3, _Doubling(), bias=bias)
    layer.weight.data.copy_(torch.arange(12.0).view(3, 4))
    if layer.bias is not None:
        layer.bias.data.fill_(1.0)
    return layer


def test_partial_sum_without_the_all_reduce():
    layer, x = _layer(bias=False), torch.ones(2, 4)
    partial = layer(x, reduce=False)
    assert torch.equal(partial, x @ layer.weight.data.T)
    assert torch.equal(layer(x), partial * 2)


def test_a_bias_needs_the_layers_own_all_reduce():
    layer = _layer(bias=True)
    assert torch.equal(layer(torch.ones(1, 4)), torch.ones(1, 4) @ layer.weight.data.T * 2 + 1)
    with pytest.raises(ValueError, match="with a bias must all-reduce"):
        layer(torch.ones(1, 4), reduce=False)

