"""The sparse mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): a top-k router and stacked experts, TP
cutting every expert's intermediate dim, and Qwen2-MoE's gated shared expert. The torch path is the CPU path and test
oracle; CUDA runs kernels.moe."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.config import ModelConfig
from tpserve.distributed.comm import Communicator
from tpserve.distributed.info import get_tp_info
from tpserve.kernels import gemv, use_fp8_triton, use_triton
from tpserve.kernels.settings import MOE_SMALL_ENV
from tpserve.layers.activation import silu_and_mul
from tpserve.layers.linear import PendingNorm, ReplicatedWeights, Slice, copy_checked, divide
from tpserve.layers.mlp import MLP
from tpserve.quant.fp8 import FP8_DTYPE, ExpertScales, dequantize_experts, num_blocks, per_row_scales, quantize_blocks

# 0: the MoE layer's RMSNorm as a kernel of its own, not in the router's GEMV and the first expert kernel (an A/B switch,
# read when the model is built)
FUSE_NORM_ENV = "TPSERVE_MOE_FUSE_NORM"
# 0: the router's top-k as a kernel of its own at one token, not inside the expert kernels (likewise)
FUSE_ROUTER_ENV = "TPSERVE_MOE_FUSE_ROUTER"
# Where one token's experts run in the CUDA GEMV (``kernels.gemv.experts``, routing themselves as the Triton kernels
# do) instead of the Triton small-batch kernels: by default FP8 experts (Qwen3-30B-A3B-FP8's batch-1 step 0.85x the
# Triton kernels'; bf16 experts 1.18x, so they keep Triton: docs/benchmarks.md, session 27); ``1``: bf16 experts
# too, ``0``: none (read at build)
EXPERT_GEMV_ENV = "TPSERVE_MOE_GEMV"
# 0: an FP8 checkpoint's experts dequantized at load even where the Triton expert kernels read FP8 (read at load)
FP8_EXPERTS_ENV = "TPSERVE_MOE_FP8"
ShardId = tuple[int, int]  # (global expert, part): gate_up_proj part 0 = gate, 1 = up; down_proj part 0


class TopKRouter(ReplicatedWeights):
    """``mlp.gate``: softmax over the experts in float32, the top k, optionally renormalised (as transformers)."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool, local: tuple[int, int] | None = None
    ) -> None:
        """``local`` (start, count): this rank's experts under expert parallelism; ``forward``'s ids are then
        relative to them, another rank's expert ``count`` with weight 0 (``localize``)."""
        super().__init__()
        self.top_k, self.norm_topk_prob, self.local = top_k, norm_topk_prob, local
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bf16_gemv = False  # the router logits through the CUDA GEMV at one token (set at load)

    def finish_loading(self, dtype: torch.dtype) -> None:
        self.bf16_gemv = gemv.bf16_gemv_enabled(self.weight.data)

    def fuses_norm(self, residual: torch.Tensor) -> bool:
        """Whether the router's GEMV can take ``PendingNorm(residual)`` whole (``kernels.gemv``'s ``norm``)."""
        return (gemv.bf16_takes_gemv(residual, self.bf16_gemv) and gemv.fuse_norm_enabled(residual)
                and gemv.supported(residual, self.weight, fused=True))

    def logits(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        """[T, num_experts]; a PendingNorm only where ``fuses_norm``."""
        if isinstance(x, PendingNorm):
            return gemv.gemv(x.residual, self.weight, norm=(x.norm.weight, x.norm.eps))
        return gemv.linear(x, self.weight, self.bf16_gemv)

    def forward(self, x: torch.Tensor | PendingNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k] int64); a PendingNorm only where ``fuses_norm``."""
        logits = self.logits(x)
        if isinstance(x, PendingNorm):
            x = x.residual
        if use_triton(x.device):
            from tpserve.kernels.moe_small import router_topk

            return router_topk(logits, self.top_k, self.norm_topk_prob, x.dtype, self.local)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        return (weights, ids) if self.local is None else localize(weights, ids, *self.local)


class SharedExpertGate(ReplicatedWeights):
    """``mlp.shared_expert_gate`` (Qwen2-MoE): the shared expert's output is scaled by sigmoid(w . x), one scalar a
    token, computed in x's dtype as transformers does."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))


def localize(weights: torch.Tensor, ids: torch.Tensor, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global expert ids to this rank's [start, start + count); another rank's expert becomes ``count`` with
    weight 0 (the expert kernels and ``experts_torch`` skip those rows)."""
    mine = (ids >= start) & (ids < start + count)
    return weights.masked_fill(~mine, 0), torch.where(mine, ids - start, count)


class StackedExperts(nn.Module):
    """``mlp.experts``: gate_up_proj [E, 2 * I_local, H] ([gate | up] rows) and down_proj [E, H, I_local].
    From an FP8 checkpoint (``use_fp8``) they load in float8_e4m3fn with their block scales
    (gate_up_proj_scale_inv [E, 2, I_local / bn, H / bk], down_proj_scale_inv [E, H / bn, I_local / bk]),
    cut at block boundaries like the linear layers'. Quantizing at load (``--quantization fp8``), each expert's
    projection is quantized into that layout as it is read (this rank's cut, 128x128 blocks), so the compute-dtype experts
    are never all held. They stay FP8 where the Triton expert kernels run (CUDA sm89+: ``scales()``), else are
    dequantized at ``finish_loading`` (the CPU path)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        tp = get_tp_info()
        # Local expert 0 is global expert expert_start. Expert parallelism gives each rank num_experts / tp whole
        # experts; else each rank holds rows [r * I / tp, (r + 1) * I / tp) of every expert (docs/design.md).
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        if self.expert_parallel:
            self.num_experts = divide(num_experts, tp.size, "num_experts")
            self.expert_start = tp.rank * self.num_experts
            self.local_intermediate, self.intermediate_start = intermediate_size, 0
        else:
            self.expert_start, self.num_experts = 0, num_experts
            self.local_intermediate = divide(intermediate_size, tp.size, "moe_intermediate_size")
            self.intermediate_start = tp.rank * self.local_intermediate
        self.full_intermediate, self.total_experts = intermediate_size, num_experts
        size = self.local_intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * size, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, hidden_size, size), requires_grad=False)
        self.gate_up_proj_scale_inv: nn.Parameter | None = None
        self.down_proj_scale_inv: nn.Parameter | None = None
        self.block_size: tuple[int, int] | None = None  # an FP8 checkpoint's weight blocks
        self.keep_dtype: tuple[str, ...] = ()
        self.dequantized = False  # loaded from FP8, computed in the compute dtype
        self.row_scales = False  # the checkpoint scales each output row (or tensor)
        self.quantizes_on_load = False  # compute-dtype checkpoint tensors, quantized as they are loaded

    def use_fp8(self, block_size: tuple[int, int], row_scales: bool = False, prequantized: bool = True) -> None:
        """Hold the experts in FP8; called before materialising. ``prequantized``: loaded as an FP8 checkpoint holds
        them (``row_scales``: a scale per output row or tensor (compressed-tensors), held as one block a row spanning
        every input, (1, K) blocks); else each compute-dtype projection is quantized in ``block_size`` blocks as it
        loads."""
        hidden, size, device = self.down_proj.shape[1], self.local_intermediate, self.down_proj.device
        if row_scales:
            block_size = (1, max(hidden, size))  # one block along every expert's inputs (H for gate/up, I for down)
        (bn, bk) = block_size
        self.block_size, self.row_scales, self.quantizes_on_load = block_size, row_scales, not prequantized
        self.gate_up_proj = nn.Parameter(torch.empty(self.gate_up_proj.shape, dtype=FP8_DTYPE, device=device),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.down_proj.shape, dtype=FP8_DTYPE, device=device),
                                      requires_grad=False)
        scales = (self.num_experts, 2, num_blocks(size, bn), num_blocks(hidden, bk))
        self.gate_up_proj_scale_inv = nn.Parameter(torch.empty(scales, device=device), requires_grad=False)
        scales = (self.num_experts, num_blocks(hidden, bn), num_blocks(size, bk))
        self.down_proj_scale_inv = nn.Parameter(torch.empty(scales, device=device), requires_grad=False)
        self.keep_dtype = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")

    def scales(self) -> ExpertScales | None:
        """The FP8 experts' block scales, or None for compute-dtype experts."""
        if self.block_size is None:
            return None
        return ExpertScales(self.gate_up_proj_scale_inv, self.down_proj_scale_inv, self.block_size)

    def finish_loading(self, dtype: torch.dtype) -> None:
        """FP8 experts kept where the Triton expert kernels read them, else dequantized to ``dtype``, one expert
        at a time."""
        if self.block_size is None:
            return
        if use_fp8_triton(self.gate_up_proj.device) and os.environ.get(FP8_EXPERTS_ENV, "1") != "0":
            self.keep_dtype = ()
            return
        gate_up, down = dequantize_experts(self.gate_up_proj, self.down_proj, self.scales(), dtype)
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)
        self.gate_up_proj_scale_inv = self.down_proj_scale_inv = None
        self.block_size, self.keep_dtype, self.dequantized = None, (), True

    def shard_ids(self, param_name: str) -> tuple[ShardId, ...]:
        """The checkpoint pieces this rank loads into ``param_name``."""
        if self.quantizes_on_load and param_name.endswith("_scale_inv"):
            return ()  # made at load from the weights, not in the checkpoint
        parts = (0, 1) if param_name.startswith("gate_up_proj") else (0,)
        experts = range(self.expert_start, self.expert_start + self.num_experts)
        return tuple((e, p) for e in experts for p in parts)

    def held_elsewhere(self, shard_id: object) -> bool:
        """Whether a checkpoint piece is another rank's expert (expert parallelism): the loader skips it."""
        if not (self.expert_parallel and isinstance(shard_id, tuple) and len(shard_id) == 2):
            return False
        return not self.expert_start <= shard_id[0] < self.expert_start + self.num_experts

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: object = None) -> None:
        """One expert's full projection ([I, H] gate/up, [H, I] down); this rank keeps its slice."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2):
            raise ValueError(f"expert weight {param_name} needs an (expert, part) shard id, got {shard_id!r}")
        expert, part = shard_id
        local = expert - self.expert_start
        size = self.local_intermediate
        rows = Slice(self.intermediate_start, size, 0, self.full_intermediate)
        if param_name.endswith("_scale_inv"):
            self._load_scale(param_name, loaded, expert, part)
        elif param_name == "gate_up_proj":
            name = f"experts.{expert}.{('gate_proj', 'up_proj')[part]}"
            weight = self._quantized(rows.cut(loaded, 0, 2, name), self.gate_up_proj_scale_inv, (local, part), name)
            copy_checked(self.gate_up_proj.data[local].narrow(0, part * size, size), weight, name)
        else:
            name = f"experts.{expert}.down_proj"
            weight = self._quantized(rows.cut(loaded, 1, 2, name), self.down_proj_scale_inv, (local,), name)
            copy_checked(self.down_proj.data[local], weight, name)

    def _quantized(self, weight: torch.Tensor, scales: nn.Parameter | None, index: tuple[int, ...],
                   name: str) -> torch.Tensor:
        """``weight`` as held: quantizing on load, its FP8 blocks (on the experts' device), their scales stored at
        ``scales[index]``; else unchanged."""
        if not self.quantizes_on_load:
            return weight
        quantized, scale_inv = quantize_blocks(weight.to(scales.device), self.block_size)
        copy_checked(scales.data[index], scale_inv, f"{name} (its FP8 block scales)")
        return quantized

    def _load_scale(self, param_name: str, loaded: torch.Tensor, expert: int, part: int) -> None:
        """This rank's block scales of one expert's projection (its intermediate dim cut at block boundaries)."""
        if self.block_size is None:
            raise ValueError(f"experts.{expert}: {param_name} in a checkpoint whose experts are not FP8")
        bn, bk = self.block_size
        local = expert - self.expert_start
        rows = Slice(self.intermediate_start, self.local_intermediate, 0, self.full_intermediate)
        if self.row_scales:
            self._load_row_scales(param_name, loaded, expert, part, local, rows)
            return
        if param_name == "gate_up_proj_scale_inv":
            proj = ("gate_proj", "up_proj")[part]
            cut = rows.blocks(bn, f"experts.{expert}.{proj} (moe_intermediate_size)")
            name = f"experts.{expert}.{proj}.weight_scale_inv"
            copy_checked(self.gate_up_proj_scale_inv.data[local, part], cut.cut(loaded, 0, 2, name), name)
        else:
            cut = rows.blocks(bk, f"experts.{expert}.down_proj (moe_intermediate_size)")
            name = f"experts.{expert}.down_proj.weight_scale_inv"
            copy_checked(self.down_proj_scale_inv.data[local], cut.cut(loaded, 1, 2, name), name)

    def _load_row_scales(self, param_name: str, loaded: torch.Tensor, expert: int, part: int, local: int,
                         rows: Slice) -> None:
        """One expert's scale per output row or per tensor: gate/up keep this rank's intermediate rows, down all its
        hidden rows (a row's scale holds for any cut of its inputs); [E, 2, I_local, 1] and [E, H, 1]."""
        if param_name == "gate_up_proj_scale_inv":
            name = f"experts.{expert}.{('gate_proj', 'up_proj')[part]}.weight_scale"
            scale = rows.cut(per_row_scales(loaded, rows.full, name), 0, 1, name)
            self.gate_up_proj_scale_inv.data[local, part, :, 0] = scale
        else:
            name = f"experts.{expert}.down_proj.weight_scale"
            self.down_proj_scale_inv.data[local, :, 0] = per_row_scales(loaded, self.down_proj.shape[1], name)


def experts_torch(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) [T, H]: the tokens sorted by expert, one
    matmul pair per expert that got any (the counts are read on the host). An id of E (another rank's
    expert: ``localize``) adds 0."""
    tokens, top_k = ids.shape
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()[: gate_up.shape[0]]
    rows = x[order // top_k]
    out = torch.zeros(tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            chunk = slice(start, start + count)
            out[order[chunk]] = F.linear(silu_and_mul(F.linear(rows[chunk], gate_up[expert])), down[expert])
            start += count
    return (out.view(tokens, top_k, -1) * weights.unsqueeze(-1)).sum(dim=1)


def experts_dense_masked(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The same sum with no host sync (every expert on every token, weighted 0 where not chosen):
    the torch path inside a CUDA graph capture when the Triton kernels are off. An id of E adds 0."""
    dense = torch.zeros(ids.shape[0], gate_up.shape[0] + 1, dtype=x.dtype, device=x.device)
    dense.scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        out += dense[:, expert : expert + 1] * F.linear(silu_and_mul(F.linear(x, gate_up[expert])), down[expert])
    return out


def run_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    scales: ExpertScales | None = None, skip_others: bool = False,
) -> torch.Tensor:
    """``skip_others``: ids may be E, another rank's expert (the torch paths always skip those)."""
    if use_triton(x.device):
        from tpserve.kernels.moe import fused_experts

        return fused_experts(x, gate_up, down, weights, ids, scales, skip_others)
    if scales is not None:
        raise ValueError("FP8 experts run only in the Triton expert kernels")
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return experts_dense_masked(x, gate_up, down, weights, ids)
    return experts_torch(x, gate_up, down, weights, ids)


def holds_whole_experts(model: nn.Module) -> bool:
    """Whether the model's MoE layers hold whole experts per rank (expert parallelism at TP > 1)."""
    return any(isinstance(m, StackedExperts) and m.expert_parallel for m in model.modules())


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator) -> None:
        super().__init__()
        moe = cfg.moe
        if moe is None:
            raise ValueError("SparseMoeBlock needs a mixture-of-experts config")
        self.comm = comm
        self.tp_size = get_tp_info().size
        self.experts = StackedExperts(moe.num_experts, cfg.hidden_size, moe.intermediate_size)
        self.expert_parallel = self.experts.expert_parallel
        local = (self.experts.expert_start, self.experts.num_experts) if self.expert_parallel else None
        self.gate = TopKRouter(cfg.hidden_size, moe.num_experts, moe.top_k, moe.norm_topk_prob, local)
        shared = moe.shared_intermediate_size
        self.shared_expert = MLP(cfg.hidden_size, shared, comm) if shared else None
        self.shared_expert_gate = SharedExpertGate(cfg.hidden_size) if shared else None
        # the A/B switches, read once at build rather than on every step
        self.norm_in_kernels = os.environ.get(FUSE_NORM_ENV, "1") != "0"
        self.route_in_kernels = os.environ.get(FUSE_ROUTER_ENV, "1") != "0"
        self.kernel_setting = os.environ.get(MOE_SMALL_ENV, "")  # experiments: the small-batch kernels' tiles
        self.expert_gemv = os.environ.get(EXPERT_GEMV_ENV, "")

    def forward(
        self, x: torch.Tensor | PendingNorm, reduce: bool = True, add_to: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Summed over the ranks, or (``reduce=False``) this rank's partial sum. A ``PendingNorm`` is normed by
        the router's GEMV and the first expert kernel as they read it (one decoding token on CUDA),
        else computed first. At one token on CUDA the expert kernels take the router's logits and its top k
        themselves (``routes_in_experts``); there, at TP 1, the down kernel adds the sum to ``add_to`` (the
        residual stream) in place and None is returned, as ``RowParallelLinear`` does (else it is ignored). That
        spares the next layer's add + RMSNorm kernel but not time: Qwen3-30B-A3B's batch-1 step 1.003x (bf16) and
        0.996x (FP8) with the kernel, within the noise (session 28); kept as the dense layers' shape. A shared expert
        (Qwen2-MoE) runs first on the normed input, and its gated output joins the experts' partial sum."""
        gate_up, down, scales = self.experts.gate_up_proj, self.experts.down_proj, self.experts.scales()
        if isinstance(x, PendingNorm) and not self.fuses_norm(x.residual):
            x = x.value()
        shared = None
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            x = x.value() if isinstance(x, PendingNorm) else x  # (fuses_norm is False with a shared expert)
            shared, add_to = self.shared_expert(x, reduce=False) * self.shared_expert_gate(x), None
        residual, norm = (x.residual, (x.norm.weight, x.norm.eps)) if isinstance(x, PendingNorm) else (x, None)
        routed = self.routes_in_experts(residual)
        if routed or norm is not None:  # the small-batch expert kernels (kernels/moe_small.py)
            from tpserve.kernels import moe_small

            config = moe_small.config_from_setting(self.gate.top_k, self.kernel_setting)
            if routed:
                logits, top_k = self.gate.logits(x), self.gate.top_k
                if self.tp_size > 1 or not gemv.fuse_norm_enabled(residual):
                    add_to = None
                if self.takes_expert_gemv(scales) and gemv.experts_unsupported(residual, gate_up, down, logits, top_k,
                                                                                scales) is None:
                    partial = gemv.experts(residual, gate_up, down, logits, top_k, self.gate.norm_topk_prob, norm,
                                           scales, add_to=add_to)
                else:
                    router = moe_small.RouterLogits(logits, top_k, self.gate.norm_topk_prob)
                    partial = moe_small.routed_experts(residual.contiguous(), gate_up, down, router, config, norm,
                                                       scales, add_to)
                if add_to is not None:
                    return None
            else:
                weights, ids = self.gate(x)
                partial = moe_small.small_batch_experts(residual.contiguous(), gate_up, down, weights, ids, config,
                                                        norm, scales, skip_others=self.expert_parallel)
        else:
            weights, ids = self.gate(x)
            partial = run_experts(x, gate_up, down, weights, ids, scales, skip_others=self.expert_parallel)
        if shared is not None:
            partial = partial + shared
        return self.comm.all_reduce(partial) if reduce else partial

    def takes_expert_gemv(self, scales: ExpertScales | None) -> bool:
        """Whether one routed token's experts go to the CUDA GEMV (``EXPERT_GEMV_ENV``): FP8 experts by default."""
        return self.expert_gemv == "1" or (self.expert_gemv != "0" and scales is not None)

    def routes_in_experts(self, x: torch.Tensor) -> bool:
        """Whether the small-batch expert kernels take the router's logits and route themselves (no router
        kernel between them: ``kernels.moe_small.routed_experts``): at one token, where the kernels' programs
        run in one wave. Qwen3-30B-A3B on an H200: 0.99x the step at batch 1, but 1.03x, 1.05x and 1.10x at
        batch 2, 4 and 8, where every program's top-k adds up (docs/benchmarks.md, session 19). Not under
        expert parallelism: these kernels (and the expert GEMVs) rank every expert, so the router kernel routes
        there, its ids local to this rank."""
        return (self.route_in_kernels and not self.expert_parallel and use_triton(x.device)
                and x.numel() == x.shape[-1]
                and self.experts.gate_up_proj.is_contiguous() and self.experts.down_proj.is_contiguous())

    def fuses_norm(self, residual: torch.Tensor) -> bool:
        """Whether the router's GEMV and the small-batch expert kernels can take ``PendingNorm(residual)``."""
        from tpserve.kernels.moe import SMALL_BATCH_MAX_ROWS

        rows = residual.numel() // residual.shape[-1] * self.gate.top_k
        return (self.norm_in_kernels and self.shared_expert is None and use_triton(residual.device)
                and rows <= SMALL_BATCH_MAX_ROWS
                and self.gate.fuses_norm(residual))
