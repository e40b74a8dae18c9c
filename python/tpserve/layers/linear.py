"""Tensor-parallel linear layers (Megatron style).

Column-parallel layers split the output features, so each rank computes a slice with no
communication; row-parallel layers split the input features, so each rank computes a partial
sum that an all-reduce completes. Every layer also knows how to cut its rank's shard out of a
full checkpoint tensor (``load_weight``), so loading never needs the whole merged tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.distributed.comm import Communicator
from tpserve.distributed.info import get_tp_info


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"tp_size {denominator} does not divide {what} {numerator}")
    return numerator // denominator


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.copy_(loaded)


class ReplicatedWeights(nn.Module):
    """Default loading for modules whose parameters every rank holds whole (norms)."""

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        copy_checked(getattr(self, param_name).data, loaded, param_name)


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.in_features = in_features
        self.out_features = divide(out_features, tp.size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        shard = loaded.narrow(0, self.tp_rank * self.out_features, self.out_features)
        copy_checked(getattr(self, param_name).data, shard, param_name)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate/up).

    Each rank's output is [its slice of part 0, its slice of part 1, ...], so SiLU-and-mul can
    pair them locally.
    """

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False) -> None:
        tp_size = get_tp_info().size
        self.local_part_sizes = [divide(p, tp_size, "intermediate_size") for p in part_sizes]
        super().__init__(in_features, sum(part_sizes), bias)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if not isinstance(shard_id, int):
            raise ValueError(f"merged weight {param_name} needs an integer part index, got {shard_id!r}")
        size = self.local_part_sizes[shard_id]
        offset = sum(self.local_part_sizes[:shard_id])
        shard = loaded.narrow(0, self.tp_rank * size, size)
        copy_checked(getattr(self, param_name).data.narrow(0, offset, size), shard, param_name)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections, split by whole heads.

    When tp_size exceeds the number of KV heads, each KV head is replicated on
    tp_size / num_kv_heads ranks (each rank keeps exactly one).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = get_tp_info()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads != 0:
                raise ValueError(
                    f"num_key_value_heads {num_kv_heads} neither divides nor is divided by tp_size {tp.size}"
                )
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        local_out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, local_out * tp.size, bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"qkv weight {param_name} needs shard id q, k or v, got {shard_id!r}")
        shard = loaded.narrow(0, start, size)
        copy_checked(getattr(self, param_name).data.narrow(0, offset, size), shard, param_name)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, comm: Communicator, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.comm = tp.rank, comm
        self.in_features = divide(in_features, tp.size, "input features")
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if param_name == "weight":
            loaded = loaded.narrow(1, self.tp_rank * self.in_features, self.in_features)
        copy_checked(getattr(self, param_name).data, loaded, param_name)
