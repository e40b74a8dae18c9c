"""A mixture-of-experts layer's experts at decode batch sizes, in two unsorted GEMV-style kernels:
each (token, k) row reads its expert id from the router's top-k and streams that expert's weights
through the CUDA cores into float32 tiles, reduced once at the end.

1. ``_moe_gate_up_silu_kernel``, grid (row, BLOCK_N slice of I): ``act = silu(gate) * up`` from
   ``gate_up[expert]`` ([E, 2I, H], gate rows first).
2. ``_moe_down_sum_kernel``, grid (token, BLOCK_N slice of H): sums ``weight_k * act[row_k] @
   down[expert_k].T`` over the token's top_k rows and writes once: no atomics, so every run and
   tensor-parallel rank gives the same bits.

``routed_experts`` (the default at one token: ``SparseMoeBlock.routes_in_experts``) hands both kernels the
router's logits instead of ids and weights: each program takes its token's top k itself (``router_top_k``,
the router kernel's arithmetic), so no router kernel runs between the router's GEMV and the experts
(Qwen3-30B-A3B's batch-1 step 0.99x; slower from 2 tokens: docs/benchmarks.md, session 19).

CUDA-graph safe (shapes by token count, no host reads); no ``tl.dot``, so the interpreter runs bf16.
Launched with PDL on Hopper (``kernels/pdl.py``): gate_up waits for the router's expert ids, then lets
the down kernel launch, which reads the ids and its experts' first K step of weights during gate_up's
run and waits only for the activations (``KernelConfig.prefetch``: Qwen3-30B-A3B's batch-1 step
0.992x, three alternating rounds, docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpserve.kernels.pdl import triton_pdl
from tpserve.quant.fp8 import ExpertScales
from tpserve.kernels.settings import MOE_SMALL_ENV as CONFIG_ENV
from tpserve.kernels.settings import int_settings

# CONFIG_ENV, for experiments: the kernels' settings in an engine, e.g. ``down_block_n=4 gate_up_block_k=512`` (read
# when a MoE layer is built), so whole steps of several settings can be timed in one process.


@dataclass(frozen=True)
class KernelConfig:
    block_n: int  # output features per program
    block_k: int  # reduction step
    num_warps: int = 4
    num_stages: int = 2  # > 1: the K loop's loads go through shared memory (cp.async), this many in flight
    experts_per_step: int = 1  # down only: how many of a token's top_k rows one step reads
    # down only, with all top_k rows in one step: the expert ids and the first K step of the weights are read
    # before the PDL wait (the gate_up kernel then waits for the ids before it lets this one launch)
    prefetch: bool = False


NO_SCALES = dict(stride_se=0, stride_sp=0, stride_sn=0, BN=1, BK=1, FP8=False, ROW_UNIFORM=True, K_UNIFORM=False)


@triton.jit
def block_scales(expert_scales, rows, rows_ok, k_first, k, mask, stride_sn, BN: tl.constexpr, BK: tl.constexpr,
                 ROW_UNIFORM: tl.constexpr, K_UNIFORM: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block scales of W's elements at ``rows`` (a program's BLOCK_N) and columns ``k`` (from ``k_first``) of the
    experts whose scales start at ``expert_scales`` (one pointer, or one per expert); the caller shapes the arguments
    so that they broadcast (gate_up: rows [N, 1], k [1, K]; down: experts [J, 1, 1], rows [1, N, 1], k [1, 1, K]).
    Where the program's rows share a row of blocks (ROW_UNIFORM) the rows' axis stays 1; where its K chunk lies in
    one block (K_UNIFORM: a scale per row, as compressed-tensors' per-channel checkpoints) the K axis does (their
    scales gathered per element made Qwen3-30B-A3B's batch-1 step 4.3x bf16's, session 44). 0 where not ``mask``."""
    if K_UNIFORM:
        if ROW_UNIFORM:
            return tl.load(expert_scales + ((tl.program_id(1) * BLOCK_N) // BN) * stride_sn + k_first // BK)
        else:
            return tl.load(expert_scales + (rows // BN) * stride_sn + k_first // BK, mask=rows_ok, other=0.0)
    elif ROW_UNIFORM:
        nb = (tl.program_id(1) * BLOCK_N) // BN
        return tl.load(expert_scales + nb * stride_sn + k // BK, mask=mask, other=0.0)
    else:
        return tl.load(expert_scales + (rows // BN) * stride_sn + k // BK, mask=mask, other=0.0)


@dataclass(frozen=True)
class SmallBatchConfig:
    gate_up: KernelConfig
    down: KernelConfig


@functools.cache
def default_config(top_k: int) -> SmallBatchConfig:
    """Within 5% of the best of benchmarks/experiments/moe_small_batch.py's batch-1 sweep (H200,
    Qwen3-30B-A3B, docs/benchmarks.md). gate_up has rows * I / BLOCK_N programs (384 there), down
    only H / BLOCK_N per token, so down reads several experts per step to keep bytes in flight. Swept again in
    whole batch-1 steps of that model (``TPSERVE_MOE_SMALL``, session 20): down's BLOCK_K 256 took 2.8% off (0.972x)
    against 128; down BLOCK_N 4, gate_up BLOCK_N 8 or BLOCK_K 512 were 3-8% slower, 3 gate_up stages or 8 down
    warps no faster."""
    return SmallBatchConfig(
        gate_up=KernelConfig(block_n=16, block_k=256, num_warps=4),
        down=KernelConfig(block_n=8, block_k=256, num_warps=4, experts_per_step=min(8, triton.next_power_of_2(top_k)),
                          prefetch=True),
    )


@functools.cache
def config_from_setting(top_k: int, setting: str = "") -> SmallBatchConfig:
    """``default_config(top_k)`` with ``setting``'s (``TPSERVE_MOE_SMALL``) changes, ``KERNEL_FIELD=INT`` each."""
    config = default_config(top_k)
    fields = {f.name for f in dataclasses.fields(KernelConfig)}
    for name, value in int_settings(setting, CONFIG_ENV):
        kernel = next((k for k in ("gate_up", "down") if name.startswith(k + "_")), None)
        field = name.removeprefix(f"{kernel}_") if kernel else name
        if kernel is None or field not in fields:
            raise ValueError(f"{CONFIG_ENV}: {name} is not gate_up_FIELD or down_FIELD with a field of {sorted(fields)}")
        value = bool(value) if field == "prefetch" else value
        config = dataclasses.replace(config, **{kernel: dataclasses.replace(getattr(config, kernel), **{field: value})})
    check_config(config.gate_up)
    check_config(config.down)
    return config


def check_config(config: KernelConfig) -> None:
    for name in ("block_n", "block_k", "num_warps", "experts_per_step"):
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of 2, got {value} in {config}")
    if config.num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {config}")


@triton.jit
def router_top_k(logits_ptr, num_experts, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, E_PAD: tl.constexpr,
                 J_PAD: tl.constexpr):
    """One token's router: softmax over its expert logits in float32, the top k (ties to the lower id),
    optionally renormalised: (ids [J_PAD] int64, weights [J_PAD] float32), slots past TOP_K zero. The
    router kernel (``router_topk``) stores these; the routed expert kernels compute them."""
    cols = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + cols, mask=cols < num_experts, other=-float("inf")).to(tl.float32)
    top = tl.max(logits, axis=0)
    denom = tl.sum(tl.exp(logits - top), axis=0)
    slots = tl.arange(0, J_PAD)
    ids = tl.zeros((J_PAD,), dtype=tl.int64)
    weights = tl.zeros((J_PAD,), dtype=tl.float32)
    remaining = logits
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.argmax(remaining, axis=0)
        prob = tl.exp(tl.max(remaining, axis=0) - top) / denom
        ids = tl.where(slots == j, best.to(tl.int64), ids)
        weights = tl.where(slots == j, prob, weights)
        total += prob
        remaining = tl.where(cols == best, -float("inf"), remaining)
    if RENORMALIZE:
        weights = weights / total
    return ids, weights


@triton.jit
def _router_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, E_PAD: tl.constexpr, J_PAD: tl.constexpr, PDL: tl.constexpr,
    local_start=0, num_local=0, LOCAL: tl.constexpr = False,
):
    """One token: softmax over the experts in float32, its top k, optionally renormalised. LOCAL (expert
    parallelism): ids relative to this rank's experts [local_start, local_start + num_local), another rank's
    expert stored as num_local with weight 0."""
    if PDL:  # the next kernel may launch now; the router's logits are the previous kernel's
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    ids, weights = router_top_k(logits_ptr + token * stride_l, num_experts, TOP_K, RENORMALIZE, E_PAD, J_PAD)
    if LOCAL:
        mine = (ids >= local_start) & (ids < local_start + num_local)
        ids = tl.where(mine, ids - local_start, num_local)
        weights = tl.where(mine, weights, 0.0)
    slots = tl.arange(0, J_PAD)
    tl.store(ids_ptr + token * TOP_K + slots, ids, mask=slots < TOP_K)
    tl.store(weights_ptr + token * TOP_K + slots, weights.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)


def router_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype, local: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``TopKRouter``'s softmax, top-k and renormalisation in one kernel (else five per MoE layer and
    step): (weights [T, k] in ``dtype``, ids [T, k] int64). ``local`` (start, count): this rank's experts
    (expert parallelism); ids are then local, another rank's expert ``count`` with weight 0 (``localize``)."""
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        pdl = triton_pdl(logits.device, tokens)
        _router_topk_kernel[(tokens,)](
            logits, weights, ids, experts, logits.stride(0),
            TOP_K=top_k, RENORMALIZE=renormalize, E_PAD=triton.next_power_of_2(max(experts, top_k)),
            J_PAD=triton.next_power_of_2(top_k), PDL=pdl,
            **(dict(local_start=local[0], num_local=local[1], LOCAL=True) if local else {}), launch_pdl=pdl,
        )
    return weights, ids


@triton.jit
def _moe_gate_up_silu_kernel(
    x_ptr, w_ptr, ids_ptr, act_ptr, norm_ptr, eps, inter, hidden,
    stride_xm, stride_we, stride_wn, stride_am,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr, WAIT_FIRST: tl.constexpr, NORM: tl.constexpr,
    num_experts=0, stride_l=0, ROUTED: tl.constexpr = False, RENORMALIZE: tl.constexpr = False,
    E_PAD: tl.constexpr = 1, J_PAD: tl.constexpr = 1,
    scale_ptr=None, stride_se=0, stride_sp=0, stride_sn=0, BN: tl.constexpr = 1, BK: tl.constexpr = 1,
    FP8: tl.constexpr = False, ROW_UNIFORM: tl.constexpr = True, K_UNIFORM: tl.constexpr = False, num_local=0,
    SKIP_OTHERS: tl.constexpr = False,
):
    """SKIP_OTHERS (expert parallelism): a row whose id is num_local has another rank's expert; its program
    writes nothing (the down kernel reads no activations for it). NORM: x is the residual stream and the experts take RMSNorm(x) * norm: each program sums x^2 as it
    reads x and scales its dot products by rsqrt(mean(x^2) + eps) at the end (the normed x unrounded).
    ROUTED: ids_ptr holds the router's logits [T, num_experts]; each program finds its row's expert itself.
    FP8: W is float8 with block scales (``ExpertScales``), applied to x per K element as it is read."""
    if PDL:  # the next kernel may launch now; the expert ids and x are earlier kernels' outputs
        if WAIT_FIRST:  # the down kernel reads the ids before its own wait: launch it only once they are final
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        else:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    if ROUTED:  # (ranking all expert pairs at once instead of k argmax steps was slower: session 19)
        ids, _ = router_top_k(ids_ptr + (row // TOP_K).to(tl.int64) * stride_l, num_experts, TOP_K, RENORMALIZE,
                              E_PAD, J_PAD)
        expert = tl.sum(tl.where(tl.arange(0, J_PAD) == row % TOP_K, ids, 0), axis=0)
    else:
        expert = tl.load(ids_ptr + row).to(tl.int64)
    if SKIP_OTHERS:
        if expert >= num_local:
            return
    x_ptrs = x_ptr + (row // TOP_K).to(tl.int64) * stride_xm + offs_k
    gate_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + inter * stride_wn
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = offs_k < hidden - k0
        if EVEN_K:
            x = tl.load(x_ptrs)
            g = tl.load(gate_ptrs, mask=n_ok[:, None], other=0.0)
            u = tl.load(up_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            g = tl.load(gate_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            u = tl.load(up_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        if NORM:
            sum_sq += x * x
            x = x * tl.load(norm_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if FP8:
            k, scales = (k0 + offs_k)[None, :], scale_ptr + expert * stride_se
            sg = block_scales(scales, offs_n[:, None], n_ok[:, None], k0, k, k_ok[None, :], stride_sn, BN, BK,
                              ROW_UNIFORM, K_UNIFORM, BLOCK_N)
            su = block_scales(scales + stride_sp, offs_n[:, None], n_ok[:, None], k0, k, k_ok[None, :], stride_sn, BN,
                              BK, ROW_UNIFORM, K_UNIFORM, BLOCK_N)
            gate += g.to(tl.float32) * (sg * x[None, :])
            up += u.to(tl.float32) * (su * x[None, :])
        else:
            gate += g.to(tl.float32) * x[None, :]
            up += u.to(tl.float32) * x[None, :]
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    g = tl.sum(gate, axis=1)
    u = tl.sum(up, axis=1)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / hidden + eps)
        g = g * rstd
        u = u * rstd
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + row.to(tl.int64) * stride_am + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _moe_down_sum_kernel(
    act_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, hidden, inter,
    stride_am, stride_we, stride_wn, stride_om,
    TOP_K: tl.constexpr, EXPERTS_PER_STEP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    num_experts=0, stride_l=0, ROUTED: tl.constexpr = False, RENORMALIZE: tl.constexpr = False,
    E_PAD: tl.constexpr = 1,
    scale_ptr=None, stride_se=0, stride_sp=0, stride_sn=0, BN: tl.constexpr = 1, BK: tl.constexpr = 1,
    FP8: tl.constexpr = False, ROW_UNIFORM: tl.constexpr = True, K_UNIFORM: tl.constexpr = False,
    ADD_TO: tl.constexpr = False, num_local=0, SKIP_OTHERS: tl.constexpr = False,
):
    """SKIP_OTHERS: rows whose id is num_local (another rank's expert) add nothing. ROUTED (with PREFETCH): ids_ptr holds the router's logits [T, num_experts]; each program routes its
    token itself (weights rounded to the output dtype, as the router kernel stores them). FP8: as in the
    gate_up kernel, the block scales applied to each expert's activations. ADD_TO: out is the residual stream,
    to which the sum, rounded to its dtype, is added (after the PDL wait: the kernels before read it)."""
    if PDL and not PREFETCH:  # as in the gate_up kernel
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, EXPERTS_PER_STEP)
    acc = tl.zeros((EXPERTS_PER_STEP, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PREFETCH:  # one step holds all TOP_K rows; W's next K step is loaded while this one is summed
        j_ok = offs_j < TOP_K
        rows = token * TOP_K + offs_j
        if ROUTED:
            expert, weight = router_top_k(ids_ptr + token * stride_l, num_experts, TOP_K, RENORMALIZE, E_PAD,
                                          EXPERTS_PER_STEP)
            weight = weight.to(out_ptr.dtype.element_ty).to(tl.float32)
        else:
            expert = tl.load(ids_ptr + rows, mask=j_ok, other=0).to(tl.int64)
            weight = tl.load(weights_ptr + rows, mask=j_ok, other=0.0).to(tl.float32)
            if SKIP_OTHERS:  # masked out, and pointed at expert 0 so that the FP8 scales' loads stay in bounds
                j_ok = j_ok & (expert < num_local)
                expert = tl.where(j_ok, expert, 0)
        w_ptrs = (w_ptr + expert[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
                  + offs_k[None, None, :])
        w_ok = j_ok[:, None, None] & n_ok[None, :, None]
        w = tl.load(w_ptrs, mask=w_ok & (offs_k < inter)[None, None, :], other=0.0)
        if PDL:  # the activations are the gate_up kernel's output
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        a_ptrs = act_ptr + rows[:, None] * stride_am + offs_k[None, :]
        for k0 in range(0, inter, BLOCK_K):
            a = tl.load(a_ptrs, mask=j_ok[:, None] & (offs_k < inter - k0)[None, :], other=0.0)
            scaled = (a.to(tl.float32) * weight[:, None])[:, None, :]
            if FP8:
                scaled = scaled * block_scales(scale_ptr + expert[:, None, None] * stride_se, offs_n[None, :, None],
                                               n_ok[None, :, None], k0, (k0 + offs_k)[None, None, :],
                                               (offs_k < inter - k0)[None, None, :], stride_sn, BN, BK, ROW_UNIFORM,
                                               K_UNIFORM, BLOCK_N)
            acc += w.to(tl.float32) * scaled
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            w = tl.load(w_ptrs, mask=w_ok & (offs_k < inter - k0 - BLOCK_K)[None, None, :], other=0.0)
    for j0 in range(0, TOP_K if not PREFETCH else 0, EXPERTS_PER_STEP):
        j_ok = offs_j < TOP_K - j0
        rows = token * TOP_K + j0 + offs_j
        expert = tl.load(ids_ptr + rows, mask=j_ok, other=0).to(tl.int64)
        weight = tl.load(weights_ptr + rows, mask=j_ok, other=0.0).to(tl.float32)
        if SKIP_OTHERS:
            j_ok = j_ok & (expert < num_local)
            expert = tl.where(j_ok, expert, 0)
        a_ptrs = act_ptr + rows[:, None] * stride_am + offs_k[None, :]
        w_ptrs = (w_ptr + expert[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
                  + offs_k[None, None, :])
        w_ok = j_ok[:, None, None] & n_ok[None, :, None]
        for k0 in tl.range(0, inter, BLOCK_K, num_stages=NUM_STAGES):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=j_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=w_ok, other=0.0)
            else:
                k_ok = offs_k < inter - k0
                a = tl.load(a_ptrs, mask=j_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=w_ok & k_ok[None, None, :], other=0.0)
            scaled = (a.to(tl.float32) * weight[:, None])[:, None, :]
            if FP8:
                scaled = scaled * block_scales(scale_ptr + expert[:, None, None] * stride_se, offs_n[None, :, None],
                                               n_ok[None, :, None], k0, (k0 + offs_k)[None, None, :],
                                               (offs_k < inter - k0)[None, None, :], stride_sn, BN, BK, ROW_UNIFORM,
                                               K_UNIFORM, BLOCK_N)
            acc += w.to(tl.float32) * scaled
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    out = tl.sum(tl.sum(acc, axis=2), axis=0).to(out_ptr.dtype.element_ty)
    if ADD_TO:
        old = tl.load(out_ptr + token * stride_om + offs_n, mask=n_ok, other=0.0)
        out = (out.to(tl.float32) + old.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_om + offs_n, out, mask=n_ok)


@dataclass(frozen=True)
class RouterLogits:
    """A MoE layer's router logits [T, E] handed to the expert kernels, which take each token's top k
    themselves (``router_top_k``) where a router kernel would otherwise run between (``routed_experts``)."""

    logits: torch.Tensor
    top_k: int
    renormalize: bool

    def kernel_args(self) -> dict:
        """The expert kernels' routing arguments."""
        experts = self.logits.shape[1]
        return dict(num_experts=experts, stride_l=self.logits.stride(0), ROUTED=True, RENORMALIZE=self.renormalize,
                    E_PAD=triton.next_power_of_2(max(experts, self.top_k)))


def gate_up_silu(
    x: torch.Tensor, gate_up: torch.Tensor, ids: torch.Tensor | RouterLogits, config: KernelConfig,
    wait_first: bool = False, norm: tuple[torch.Tensor, float] | None = None, scales: ExpertScales | None = None,
    skip_others: bool = False,
) -> torch.Tensor:
    """act [T * k, I]: silu(gate) * up of each (token, k) row's expert; gate_up [E, 2I, H]. ``wait_first``:
    the next kernel (a prefetching down_sum) launches only once the ids are final. ``norm`` (weight, eps):
    the experts take RMSNorm(x) * weight, computed as x is read. ``scales``: gate_up is FP8. ``skip_others``:
    ids equal to E are another rank's experts (expert parallelism), whose rows are left unwritten."""
    check_config(config)
    routed = isinstance(ids, RouterLogits)
    if routed and skip_others:
        raise ValueError("gate_up_silu: the routed kernels take the top k of every expert, not of this rank's")
    top_k = ids.top_k if routed else ids.shape[1]
    rows, inter, hidden = x.shape[0] * top_k, gate_up.shape[1] // 2, gate_up.shape[2]
    act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    pdl = triton_pdl(x.device, x.shape[0])
    norm_weight, eps = norm if norm is not None else (x, 0.0)
    routing = ids.kernel_args() | {"J_PAD": triton.next_power_of_2(top_k)} if routed else {}
    _moe_gate_up_silu_kernel[(rows, triton.cdiv(inter, config.block_n))](
        x, gate_up, ids.logits if routed else ids, act, norm_weight, eps, inter, hidden, x.stride(0),
        gate_up.stride(0), gate_up.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=hidden % config.block_k == 0,
        NUM_STAGES=config.num_stages, PDL=pdl, WAIT_FIRST=wait_first, NORM=norm is not None, **routing,
        **_scale_args(scales, "gate_up", config.block_n, config.block_k, hidden, x), **_skip_args(skip_others, gate_up),
        num_warps=config.num_warps, launch_pdl=pdl,
    )
    return act


def down_sum(
    act: torch.Tensor, down: torch.Tensor, weights: torch.Tensor | None, ids: torch.Tensor | RouterLogits,
    config: KernelConfig, scales: ExpertScales | None = None, add_to: torch.Tensor | None = None,
    skip_others: bool = False,
) -> torch.Tensor:
    """out [T, H] = sum_k weights[t, k] * act[t * k + k] @ down[ids[t, k]].T; down [E, H, I]. With
    ``RouterLogits`` (weights None) the config must prefetch (``prefetches``). ``scales``: down is FP8.
    ``add_to`` [T, H]: out, rounded to its dtype, is added to it in place (the residual stream); it is returned.
    ``skip_others``: rows whose id is E (another rank's expert) add nothing."""
    check_config(config)
    routed = isinstance(ids, RouterLogits)
    if routed and skip_others:
        raise ValueError("down_sum: the routed kernels take the top k of every expert, not of this rank's")
    top_k = ids.top_k if routed else ids.shape[1]
    tokens = act.shape[0] // top_k
    experts_per_step = min(config.experts_per_step, triton.next_power_of_2(top_k))
    if routed and not prefetches(config, top_k):
        raise ValueError(f"the routed down kernel reads all {top_k} experts in its first step, not {config}")
    hidden, inter = down.shape[1], down.shape[2]
    if add_to is not None and (add_to.shape != (tokens, hidden) or add_to.dtype != act.dtype
                               or add_to.stride(-1) != 1):
        raise ValueError(f"down_sum: add_to must be {act.dtype} [{tokens}, {hidden}] with unit stride along H, got "
                         f"{add_to.dtype} {list(add_to.shape)}")
    out = add_to if add_to is not None else torch.empty(tokens, hidden, dtype=act.dtype, device=act.device)
    pdl = triton_pdl(act.device, tokens)
    routing = ids.kernel_args() if routed else {}
    _moe_down_sum_kernel[(tokens, triton.cdiv(hidden, config.block_n))](
        act, down, ids.logits if routed else ids, act if weights is None else weights, out, hidden, inter,
        act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        TOP_K=top_k, EXPERTS_PER_STEP=experts_per_step, PREFETCH=prefetches(config, top_k),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=inter % config.block_k == 0,
        NUM_STAGES=config.num_stages, PDL=pdl, **routing,
        **_scale_args(scales, "down", config.block_n, config.block_k, inter, act),
        ADD_TO=add_to is not None, **_skip_args(skip_others, down), num_warps=config.num_warps, launch_pdl=pdl,
    )
    return out


def _skip_args(skip_others: bool, experts: torch.Tensor) -> dict:
    return dict(num_local=experts.shape[0], SKIP_OTHERS=True) if skip_others else {}


def _scale_args(scales: ExpertScales | None, which: str, block_n: int, block_k: int, k: int,
                dummy: torch.Tensor) -> dict:
    """The expert kernels' scale arguments for ``gate_up`` or ``down`` (ROW_UNIFORM: a program's ``block_n``
    rows, aligned, share one row of scales; K_UNIFORM: each ``block_k`` chunk of a row's ``k`` lies in one block)."""
    if scales is None:
        return dict(NO_SCALES, scale_ptr=dummy)
    scale = scales.gate_up if which == "gate_up" else scales.down
    part = scale.stride(1) if which == "gate_up" else 0
    return dict(scale_ptr=scale, stride_se=scale.stride(0), stride_sp=part, stride_sn=scale.stride(-2),
                BN=scales.block[0], BK=scales.block[1], FP8=True, ROW_UNIFORM=scales.block[0] % block_n == 0,
                K_UNIFORM=scales.block[1] % block_k == 0 or scales.block[1] >= k)


def prefetches(down: KernelConfig, top_k: int) -> bool:
    return down.prefetch and down.experts_per_step >= top_k


def small_batch_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    config: SmallBatchConfig | None = None, norm: tuple[torch.Tensor, float] | None = None,
    scales: ExpertScales | None = None, skip_others: bool = False,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) [T, H]; x unit stride along H, weights contiguous.
    ``norm`` (weight, eps): of RMSNorm(x) * weight instead, normed as the first kernel reads x. ``scales``:
    the experts are FP8. ``skip_others``: ids equal to E are another rank's experts (expert parallelism)."""
    if ids.numel() == 0:
        return torch.zeros_like(x)
    if config is None:
        config = default_config(ids.shape[1])
    ids, weights = ids.contiguous(), weights.contiguous()
    act = gate_up_silu(x, gate_up, ids, config.gate_up, wait_first=prefetches(config.down, ids.shape[1]), norm=norm,
                       scales=scales, skip_others=skip_others)
    return down_sum(act, down, weights, ids, config.down, scales, skip_others=skip_others)


def routed_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, router: RouterLogits,
    config: SmallBatchConfig | None = None, norm: tuple[torch.Tensor, float] | None = None,
    scales: ExpertScales | None = None, add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """``small_batch_experts`` from the router's logits: the two kernels take each token's top k themselves,
    so no router kernel runs between the router's GEMV and them (a config that does not prefetch the down
    kernel's experts runs the router kernel first). ``add_to``: as ``down_sum``'s."""
    if x.shape[0] == 0:
        return torch.zeros_like(x) if add_to is None else add_to
    if config is None:
        config = default_config(router.top_k)
    if not prefetches(config.down, router.top_k):
        weights, ids = router_topk(router.logits, router.top_k, router.renormalize, x.dtype)
        out = small_batch_experts(x, gate_up, down, weights, ids, config, norm, scales)
        return out if add_to is None else add_to.add_(out)
    act = gate_up_silu(x, gate_up, router, config.gate_up, wait_first=True, norm=norm, scales=scales)
    return down_sum(act, down, None, router, config.down, scales, add_to)
