"""The dense gated MLP (SwiGLU; Gemma's GELU): gate/up column-parallel (merged), down row-parallel. A dense layer's MLP,
and Qwen2-MoE's shared expert."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.distributed.comm import Communicator
from tpserve.layers.activation import act_and_mul
from tpserve.layers.linear import MergedColumnParallelLinear, PendingNorm, RowParallelLinear
from tpserve.layers.lora import LoRABatch


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, comm: Communicator, activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, comm)

    def forward(
        self, x: torch.Tensor | PendingNorm, reduce: bool = True, add_to: torch.Tensor | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor | None:
        if self.activation == "silu":  # in the GEMV's epilogue where it runs
            hidden = self.gate_up_proj.silu_and_mul(x, lora)
        else:  # never a SiLU-fused kernel: the projection (which may still norm a PendingNorm), then the activation
            hidden = act_and_mul(self.gate_up_proj(x, lora), self.activation)
        return self.down_proj(hidden, reduce=reduce, add_to=add_to, lora=lora)
