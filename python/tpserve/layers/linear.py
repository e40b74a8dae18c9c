"""Tensor-parallel linear layers (Megatron style) that cut their rank's shard out of full checkpoint
tensors; FP8 block scales are cut with their weights, so a shard boundary inside a block is an error."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tpserve.distributed.comm import Communicator
from tpserve.distributed.info import get_tp_info
from tpserve.kernels import gemv, use_fp8_gemm
from tpserve.kernels.fp8_linear import backend_from_env, check_weight_block, fp8_linear, kernel_for, resolve_backend
from tpserve.layers.activation import silu_and_mul
from tpserve.layers.lora import LoRABatch, LoRAWeights
from tpserve.quant.fp8 import FP8_DTYPE, dequantize_blocks, num_blocks, quantize_blocks, per_row_scales


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"tp_size {denominator} does not divide {what} {numerator}")
    return numerator // denominator


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.copy_(loaded)


@dataclass(frozen=True)
class Slice:
    """A rank's part of a checkpoint tensor along the sharded dim: ``size`` elements from
    ``start`` of the tensor's ``full``, copied to ``dest`` of the rank's parameter."""

    start: int
    size: int
    dest: int
    full: int

    def blocks(self, block: int, what: str) -> "Slice":
        """The same part of the block scales (one per ``block`` elements)."""
        end = self.start + self.size
        if self.start % block or self.dest % block or (end % block and end != self.full):
            raise ValueError(
                f"{what}: this rank's part is {self.size} of {self.full} features (at offset {self.start}, "
                f"placed at {self.dest} of the merged weight), which cuts a quantization block of {block}; "
                "FP8 block scales can only be split and merged at block boundaries (choose another tp_size)"
            )
        first = self.start // block
        return Slice(first, num_blocks(end, block) - first, self.dest // block, num_blocks(self.full, block))

    def cut(self, loaded: torch.Tensor, dim: int, dims: int, name: str) -> torch.Tensor:
        """This part of ``loaded`` along ``dim``, once ``loaded`` is checked to have ``dims`` dimensions and ``full``
        elements along ``dim`` (a checkpoint tensor of another size would be cut to fit, silently)."""
        if loaded.dim() != dims or loaded.shape[dim] != self.full:
            raise ValueError(f"{name}: expected {dims} dimensions with {self.full} along dim {dim}, got shape "
                             f"{tuple(loaded.shape)}")
        return loaded.narrow(dim, self.start, self.size)


@dataclass(frozen=True)
class PendingNorm:
    """``norm(residual)`` not computed yet: a linear layer whose GEMV norms its input as it reads it
    (``kernels.gemv``'s ``norm``, at one token) takes it whole; anything else calls ``value()``."""

    residual: torch.Tensor
    norm: nn.Module  # a layers.norm.RMSNorm: weight, eps; norm(x) computes it

    def value(self) -> torch.Tensor:
        return self.norm(self.residual)


class ReplicatedWeights(nn.Module):
    """Default loading for modules whose parameters every rank holds whole (norms)."""

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        copy_checked(getattr(self, param_name).data, loaded, param_name)


class ParallelLinear(nn.Module):
    """This rank's weight [out, in] (FP8 after ``use_fp8``) and bias; as such, column-parallel."""

    split_dim: int = 0  # the dim of the weight that is sharded: 1 for row-parallel layers

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_scale_inv: nn.Parameter | None = None
        self.block_size: tuple[int, int] | None = None  # set when the weight is FP8-quantized
        self.keep_dtype: tuple[str, ...] = ()  # parameters the compute dtype does not apply to
        self.fp8_backend = "auto"  # the GPU GEMM of FP8 weights (kernels.fp8_linear)
        self.bf16_gemv = False  # bf16 weight: the CUDA GEMV at one token (kernels.gemv)
        self.row_scales = False  # FP8 scales per output row or tensor (compressed-tensors), not per block
        self.lora: LoRAWeights | None = None  # LoRA adapters' slots (tpserve.lora), where one adapts this layer
        self.output_multiplier = 1.0  # Granite's residual_multiplier, folded into the weights (models/loader.py)

    def use_fp8(self, block_size: tuple[int, int], prequantized: bool, row_scales: bool = False) -> None:
        """Hold the weight in FP8 (loaded so if ``prequantized``); called before materialising. ``row_scales``: the
        checkpoint scales each output row (or the whole tensor), held as [rows, 1]: one block a row spanning this
        rank's inputs, which every kernel reads as it is (the GEMV, the row-wise GEMM, ``_scaled_mm``'s [1, N])."""
        if row_scales:
            block_size = (1, self.in_features)
        self.block_size, self.row_scales = block_size, row_scales
        if prequantized:
            device = self.weight.device
            self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=FP8_DTYPE, device=device), requires_grad=False)
            scales = (num_blocks(self.out_features, block_size[0]), num_blocks(self.in_features, block_size[1]))
            self.weight_scale_inv = nn.Parameter(torch.empty(scales, dtype=torch.float32, device=device), requires_grad=False)
            self.keep_dtype = ("weight", "weight_scale_inv")

    def finish_loading(self, dtype: torch.dtype) -> None:
        """Keep the FP8 weight where the FP8 GEMM runs, else dequantize it to ``dtype`` (quantized
        first when quantizing at load time, so the numbers are those the GPU would use)."""
        if self.block_size is None:
            self.bf16_gemv = gemv.bf16_gemv_enabled(self.weight.data)
            return
        fp8_compute = use_fp8_gemm(self.weight.device, self.block_size, self.row_scales)
        backend = "auto"
        if fp8_compute:
            backend = resolve_backend(backend_from_env(), self.weight.device, dtype, self.block_size, self.in_features,
                                      self.row_scales)
        block = self.block_size
        if self.weight_scale_inv is None:
            weight, scale_inv = quantize_blocks(self.weight.data, block)
        else:
            weight, scale_inv = self.weight.data, self.weight_scale_inv.data
        if fp8_compute:
            check_weight_block(backend, block, self.in_features, self.row_scales)
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.weight_scale_inv = nn.Parameter(scale_inv, requires_grad=False)
            self.fp8_backend = backend
        else:
            self.weight = nn.Parameter(dequantize_blocks(weight, scale_inv, block, dtype), requires_grad=False)
            self.weight_scale_inv, self.block_size = None, None
        self.keep_dtype = ()

    def forward(self, x: torch.Tensor | PendingNorm, lora: LoRABatch | None = None) -> torch.Tensor:
        """``lora``: the step's adapters, added to the output where they adapt this layer (no fused GEMV then)."""
        if lora is not None and self.lora is not None and self.lora.adapts(lora):
            x = x.value() if isinstance(x, PendingNorm) else x
            return self.matmul(x, self.bias) + self.lora.delta(x, lora)
        if isinstance(x, PendingNorm):
            if self.fuses(x.residual):
                y = self.gemv(x.residual, norm=(x.norm.weight, x.norm.eps))
                return y if self.bias is None else y + self.bias
            x = x.value()
        return self.matmul(x, self.bias)

    def gemv(self, x: torch.Tensor, **fusion: Any) -> torch.Tensor:
        """``kernels.gemv.gemv`` of this layer's weight (its scales as held: per block or a row); ``fusion``: its
        ``silu_mul``, ``norm``, ``add_to``."""
        return gemv.gemv(x, self.weight, self.weight_scale_inv, row_scales=self.row_scales, **fusion)

    def gemv_supported(self, x: torch.Tensor, silu_mul: bool = False, fused: bool = False) -> bool:
        return gemv.supported(x, self.weight, self.weight_scale_inv, silu_mul, fused=fused, row_scales=self.row_scales)

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether ``matmul(x)`` runs the CUDA GEMV (kernels.gemv)."""
        if self.weight_scale_inv is None:
            return gemv.bf16_takes_gemv(x, self.bf16_gemv)
        return kernel_for(self.fp8_backend, x.numel() // x.shape[-1]) == "cuda"

    def fuses(self, x: torch.Tensor, silu_mul: bool = False) -> bool:
        """Whether the GEMV takes ``x`` with a norm or add fused (``kernels.gemv``: one token)."""
        return (gemv.fuse_norm_enabled(x) and self.takes_gemv(x)
                and self.gemv_supported(x, silu_mul, fused=True))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_scale_inv is None:
            return gemv.linear(x, self.weight, self.bf16_gemv, bias)
        y = fp8_linear(x, self.weight, self.weight_scale_inv, self.block_size, self.fp8_backend, self.row_scales)
        return y if bias is None else y + bias

    def part(self, shard_id: str | int | None) -> Slice:
        """The rank's part of the checkpoint tensor named by ``shard_id``, along ``split_dim``."""
        size = self.weight.shape[self.split_dim]
        return Slice(self.tp_rank * size, size, 0, size * self.tp_size)

    def checkpoint_rows(self, shard_ids: Iterable[str | int | None]) -> tuple[int, ...]:
        """Each part's rows in the checkpoint, unsharded: how a tensor that fuses the parts (Phi-3's) splits."""
        return tuple(self.part(shard_id).full for shard_id in shard_ids)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        param = getattr(self, param_name).data
        dim = self.split_dim
        if param_name == "bias" and dim == 1:  # a row-parallel bias is added once, after the all-reduce
            copy_checked(param, loaded, param_name)
            return
        if param_name == "weight_scale_inv" and self.row_scales:
            self._load_row_scales(param, loaded, shard_id)
            return
        part = self.part(shard_id)
        if param_name == "weight_scale_inv" and self.block_size is not None:
            part = part.blocks(self.block_size[dim], f"{param_name} (weight_block_size {list(self.block_size)})")
        copy_checked(param.narrow(dim, part.dest, part.size), part.cut(loaded, dim, param.dim(), param_name), param_name)

    def _load_row_scales(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        """A checkpoint's scale per output row ([rows, 1] or [rows]) or per tensor (one element), into [rows, 1]: rows
        are cut as the weight's; a row-parallel layer keeps them all (a row's scale holds for any cut of its inputs)."""
        name = "weight_scale"
        if self.split_dim == 1:
            part = Slice(0, param.shape[0], 0, param.shape[0])
        else:
            part = self.part(shard_id)
        rows = part.cut(per_row_scales(loaded, part.full, name), 0, 1, name)
        param.narrow(0, part.dest, part.size).copy_(rows[:, None])


class ColumnParallelLinear(ParallelLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, divide(out_features, get_tp_info().size, "output features"), bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel projections of one input in one matmul (gate/up): each rank's output is
    [its slice of part 0, its slice of part 1, ...], so SiLU-and-mul pairs them locally."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False) -> None:
        tp_size = get_tp_info().size
        self.local_part_sizes = [divide(p, tp_size, "intermediate_size") for p in part_sizes]
        super().__init__(in_features, sum(part_sizes), bias)
        self.gemv_silu_mul = False  # set at load: silu_and_mul in the GEMV where it runs

    def part(self, shard_id: str | int | None) -> Slice:
        if not isinstance(shard_id, int):
            raise ValueError(f"merged weight needs an integer part index, got {shard_id!r}")
        size = self.local_part_sizes[shard_id]
        return Slice(self.tp_rank * size, size, sum(self.local_part_sizes[:shard_id]), size * self.tp_size)

    def finish_loading(self, dtype: torch.dtype) -> None:
        super().finish_loading(dtype)
        gate, *rest = self.local_part_sizes
        self.gemv_silu_mul = rest == [gate] and self.bias is None and gemv.silu_mul_enabled()

    def silu_and_mul(self, x: torch.Tensor | PendingNorm, lora: LoRABatch | None = None) -> torch.Tensor:
        """SiLU(gate) * up of the two parts; in the GEMV's epilogue at the batches that take the GEMV
        (which also norms a PendingNorm as it reads it)."""
        if lora is not None and self.lora is not None and self.lora.adapts(lora):
            return silu_and_mul(self(x, lora))
        if self.gemv_silu_mul and isinstance(x, PendingNorm) and self.fuses(x.residual, silu_mul=True):
            norm = (x.norm.weight, x.norm.eps)
            return self.gemv(x.residual, silu_mul=True, norm=norm)
        if isinstance(x, PendingNorm):
            x = x.value()
        if self.gemv_silu_mul and self.takes_gemv(x) and self.gemv_supported(x, silu_mul=True):
            return self.gemv(x, silu_mul=True)
        return silu_and_mul(self(x))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections, split by whole heads; when tp_size exceeds the KV heads, each KV
    head is replicated on tp_size / num_kv_heads ranks (each rank keeps one)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = get_tp_info()
        self.head_dim = head_dim
        self.total_kv_heads = num_kv_heads
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
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp.size, bias)

    def part(self, shard_id: str | int | None) -> Slice:
        if shard_id == "q":
            return Slice(self.tp_rank * self.q_size, self.q_size, 0, self.q_size * self.tp_size)
        if shard_id in ("k", "v"):
            dest = self.q_size + (self.kv_size if shard_id == "v" else 0)
            return Slice(self.kv_head_start * self.head_dim, self.kv_size, dest, self.total_kv_heads * self.head_dim)
        raise ValueError(f"qkv weight needs shard id q, k or v, got {shard_id!r}")


class RowParallelLinear(ParallelLinear):
    split_dim = 1

    def __init__(self, in_features: int, out_features: int, comm: Communicator, bias: bool = False) -> None:
        super().__init__(divide(in_features, get_tp_info().size, "input features"), out_features, bias)
        self.comm = comm

    def forward(
        self, x: torch.Tensor, reduce: bool = True, add_to: torch.Tensor | None = None, lora: LoRABatch | None = None
    ) -> torch.Tensor | None:
        """Summed over the ranks, or (``reduce=False``) this rank's partial sum for all_reduce_add_rmsnorm.
        ``add_to`` (the residual stream): at TP 1 where the GEMV runs, the output is added to it in
        place and None returned; else it is ignored. ``lora``: the step's adapters, added to this rank's partial sum."""
        lora = lora if lora is not None and self.lora is not None and self.lora.adapts(lora) else None
        if add_to is not None and lora is None and self.tp_size == 1 and self.bias is None and self.fuses(x):
            self.gemv(x, add_to=add_to)
            return None
        y = self.matmul(x, None)
        if lora is not None:
            y = y + self.lora.delta(x, lora)
        if not reduce:
            if self.bias is not None:
                raise ValueError("a row-parallel layer with a bias must all-reduce its output itself")
            return y
        y = self.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias
