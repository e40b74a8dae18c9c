"""Batched next-token sampling that every tensor-parallel rank computes identically.

Each row has its own temperature, top-k, top-p, min-p and seed; the torch path here is vectorised
(no Python loop over rows or tokens), runs on every device and is the reference. Randomness is
counter-based: the noise for request ``i`` at output step ``s`` and vocab index ``v`` is a pure
function of ``(seed_i, s, v)`` (``random_bits``), exact integer arithmetic, so ranks with identical
logits pick identical tokens without communicating, and a seeded request samples the same tokens
whatever shares its batch (exp/log may differ by an ulp between devices: only a near tie can flip).

A sampled row (temperature 0 is a plain argmax): ``w = exp((logits - max) / t)`` (top weight
exactly 1); top-k keeps the k largest; top-p the smallest largest-first prefix whose mass,
renormalised over what top-k kept, reaches ``top_p``; min-p drops ``w < min_p``; then
``token = argmax(w / E)``, ``E ~ Exp(1)`` per token (Gumbel-max in exponential form), which draws
from the kept weights without renormalising. Each filter is a per-row threshold, so tokens tied
with the last kept one are kept too: the result never depends on how a sort orders ties.

On CUDA with Triton, ``tpserve.kernels.sampling`` computes the same race with the same noise in one
kernel, finding the cut-offs by bisection instead of a sort.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from tpserve.engine.batch import upload
from tpserve.engine.logit_edits import LogitEdits
from tpserve.kernels import use_triton
from tpserve.sampling_params import SamplingParams

_MASK32 = 0xFFFF_FFFF
# Multipliers of the splitmix32 output function (hash-prospector). Both are below 2**31, so a
# uint32 held in an int64 times either stays below 2**63: no signed overflow on any device.
_MUL1 = 0x21F0_AAAD
_MUL2 = 0x735A_2D97
# Distinct starting values keep the row keys and the column keys apart.
_ROW_DOMAIN = 0x9E37_79B9
_COL_DOMAIN = 0x85EB_CA6B
# Temperatures are float32 on the device: a larger one would be inf there, and (-inf - max) / inf
# is NaN (a masked token would win the race); the largest finite one is as flat as inf anyway.
FLOAT32_MAX = torch.finfo(torch.float32).max
_UNIFORM_BITS = 23  # k + 0.5 is exact in float32 for k < 2**23, so u never rounds to 0 or 1


class Workspace:
    """Large scratch tensors reused from step to step, by name, on CPU only: there fresh B x V
    tensors are page-faulted in every step at more cost than the arithmetic (on CUDA the caching
    allocator reuses memory). Buffers above ``max_retained_bytes`` are not kept, so one burst of a
    large batch does not hold its peak (hundreds of MB at a 150k vocabulary) for good."""

    def __init__(self, max_retained_bytes: int = 16 << 20) -> None:
        self.max_retained_bytes = max_retained_bytes
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def retained_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def empty(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        if device.type != "cpu" or numel * dtype.itemsize > self.max_retained_bytes:
            return torch.empty(shape, dtype=dtype, device=device)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            buffer = self._buffers[name] = torch.empty(numel, dtype=dtype)
        return buffer[:numel].view(shape)


def _mix32_(x: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """In place: splitmix32's output function on uint32s held in int64. Every intermediate stays in
    [0, 2**63), so ``>>`` is a logical shift, bit-identical to uint32 arithmetic on every device."""
    tmp = torch.empty_like(x) if scratch is None else scratch
    for mul, shift in ((_MUL1, 16), (_MUL2, 15)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        x.bitwise_xor_(tmp).mul_(mul).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 15, out=tmp)
    return x.bitwise_xor_(tmp)


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] uint32 key per (seed, step): their four 32-bit words absorbed one mix at a time."""
    key = torch.full_like(seeds, _ROW_DOMAIN)
    for word in (seeds, seeds >> 32, steps, steps >> 32):
        key = _mix32_(key ^ (word & _MASK32))
    return key


def _col_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] uint32 key per vocab index."""
    return _mix32_(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _COL_DOMAIN)


def random_bits(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int, ws: Workspace | None = None) -> torch.Tensor:
    """[B, V] int64 holding uniform uint32s: ``mix32(row_key(seed, step) ^ col_key(v))``."""
    ws = ws or Workspace()
    shape = (seeds.shape[0], vocab_size)
    bits = ws.empty("bits", shape, torch.int64, seeds.device)
    row_keys, col_keys = _row_keys(seeds, steps), _col_keys(vocab_size, seeds.device)
    torch.bitwise_xor(row_keys[:, None], col_keys[None, :], out=bits)
    return _mix32_(bits, ws.empty("scratch", shape, torch.int64, seeds.device))


def uniform_noise(
    seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int, ws: Workspace | None = None
) -> torch.Tensor:
    """[B, V] float32 uniforms in the open interval (0, 1): ``((bits >> 9) + 0.5) / 2**23``."""
    ws = ws or Workspace()
    bits = random_bits(seeds, steps, vocab_size, ws).bitwise_right_shift_(32 - _UNIFORM_BITS)
    u = ws.empty("noise", tuple(bits.shape), torch.float32, bits.device).copy_(bits)
    return u.add_(0.5).mul_(2.0**-_UNIFORM_BITS)


def _row(table: str, index: int, doc: str) -> property:
    """A SamplingBatch parameter: row ``index`` of an uploaded table, its B rows in use."""
    return property(lambda batch: getattr(batch, table)[index, : batch.size], doc=doc)


@dataclass
class SamplingBatch:
    """One step's sampling parameters, one row per request. Their device tensors are uploaded on
    first use: an all-greedy step's argmax reads none of them, and each copy left out is one
    operation fewer between two decode steps' CUDA graphs (benchmarks/experiments/step_timeline.py)."""

    host_floats: torch.Tensor  # [3, W] float32 rows: temperatures (0 for greedy rows), top-p, min-p
    host_ints: torch.Tensor  # [3, W] int64 rows: top-k (vocab size when disabled), seeds, steps (0 = first token)
    size: int  # B, the rows in use (W pads them to 16-byte units)
    device: torch.device
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    any_greedy: bool = True
    # rows that need top-k/top-p (None: every row) and how many largest weights they need (None:
    # the whole vocab, for top-p without top-k)
    host_sort_rows: list[int] | None = None
    sort_width: int | None = None
    edits: LogitEdits | None = None

    @cached_property
    def _floats(self) -> torch.Tensor:
        return upload(self.host_floats, self.device)

    @cached_property
    def _ints(self) -> torch.Tensor:
        return upload(self.host_ints, self.device)

    temperatures = _row("_floats", 0, "[B] float32, 0 for greedy rows")
    top_ps = _row("_floats", 1, "[B] float32")
    min_ps = _row("_floats", 2, "[B] float32")
    top_ks = _row("_ints", 0, "[B] int64, the vocab size when disabled")
    seeds = _row("_ints", 1, "[B] int64")
    steps = _row("_ints", 2, "[B] int64, the index of the output token being generated")

    @cached_property
    def sort_rows(self) -> torch.Tensor | None:  # [R] int64
        if self.host_sort_rows is None:
            return None
        return upload(torch.tensor(self.host_sort_rows, dtype=torch.int64), self.device)

    @property
    def needs_filter(self) -> bool:
        return self.needs_top_k or self.needs_top_p or self.needs_min_p

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int], vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        if not len(params) == len(seeds) == len(steps):
            raise ValueError(f"got {len(params)} params, {len(seeds)} seeds and {len(steps)} steps")
        greedy = [p.greedy for p in params]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        uses_top_k = [not g and k < vocab_size for g, k in zip(greedy, top_ks)]
        uses_top_p = [not g and p.top_p < 1.0 for g, p in zip(greedy, params)]
        uses_min_p = [not g and p.min_p > 0.0 for g, p in zip(greedy, params)]
        sort_rows = [i for i, (k, p) in enumerate(zip(uses_top_k, uses_top_p)) if k or p]
        # One upload per dtype, rows padded to 16-byte units: Triton compiles a variant per pointer
        # alignment, and a batch size that changed it would stall a step on a compile.
        batch = len(params)
        width = -(-max(batch, 1) // 4) * 4
        floats = torch.zeros((3, width), dtype=torch.float32)
        floats[:, :batch] = torch.tensor(
            [[0.0 if g else min(p.temperature, FLOAT32_MAX) for g, p in zip(greedy, params)],
             [p.top_p for p in params], [p.min_p for p in params]],
            dtype=torch.float32,
        )
        ints = torch.zeros((3, width), dtype=torch.int64)
        ints[:, :batch] = torch.tensor([top_ks, list(seeds), list(steps)], dtype=torch.int64)
        return cls(
            host_floats=floats,
            host_ints=ints,
            size=batch,
            device=torch.device(device),
            all_greedy=all(greedy),
            needs_top_k=any(uses_top_k),
            needs_top_p=any(uses_top_p),
            needs_min_p=any(uses_min_p),
            any_greedy=any(greedy),
            host_sort_rows=None if len(sort_rows) == len(params) else sort_rows,
            sort_width=max((top_ks[i] for i in sort_rows), default=None),
        )


class Sampler:
    """Picks one token per row from ``[B, V]`` logits of any float dtype; see the module doc."""

    def __init__(self) -> None:
        self._ws = Workspace()
        self._greedy_counters: torch.Tensor | None = None  # the greedy kernel's per-row counts, left zero

    def fuses_mask(self, logits: torch.Tensor, batch: SamplingBatch) -> bool:
        """Whether ``__call__`` takes a grammar bitmask (the unfiltered Triton kernel applies it as
        it reads the logits); otherwise mask the logits first."""
        return use_triton(logits.device) and logits.stride(-1) == 1 and not batch.needs_filter

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """``bitmask``: [B, ceil(V / 32)] int32 grammar masks of every row, only where ``fuses_mask``."""
        if bitmask is not None:
            if not self.fuses_mask(logits, batch):
                raise ValueError("this sampler path takes no bitmask: mask the logits first")
            from tpserve.kernels.sampling import sample

            return sample(logits, batch.temperatures, batch.seeds, batch.steps, bitmask=bitmask)
        if batch.all_greedy:
            return self._greedy(logits)
        if use_triton(logits.device) and logits.stride(-1) == 1:
            from tpserve.kernels.sampling import sample

            if not batch.needs_filter:
                return sample(logits, batch.temperatures, batch.seeds, batch.steps)
            # Every row, filtered or not, in the kernel's bisection variant (no sort).
            return sample(
                logits, batch.temperatures, batch.seeds, batch.steps, batch.top_ks, batch.top_ps, batch.min_ps
            )
        return self.sample_torch(logits, batch)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        if not (use_triton(logits.device) and logits.dim() == 2 and logits.stride(-1) == 1):
            return logits.argmax(dim=-1)
        from tpserve.kernels.sampling import greedy

        rows = logits.shape[0]
        if self._greedy_counters is None or self._greedy_counters.numel() < rows:
            self._greedy_counters = torch.zeros(max(rows, 256), dtype=torch.int32, device=logits.device)
        return greedy(logits, self._greedy_counters)

    def sample_torch(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        weights = _tempered_weights(logits, batch.temperatures, self._ws)
        threshold = _keep_thresholds(weights, batch)
        if threshold is not None:
            weights.masked_fill_(weights < threshold[:, None], 0.0)
        u = uniform_noise(batch.seeds, batch.steps, logits.shape[-1], self._ws)
        tokens = weights.div_(u.log_().neg_()).argmax(dim=-1)
        if batch.any_greedy:
            tokens = torch.where(batch.temperatures == 0, logits.argmax(dim=-1), tokens)
        return tokens


def _tempered_weights(logits: torch.Tensor, temperatures: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """float32 ``exp((logits - max) / t)``; greedy rows (t = 0) get t = 1, their result unused."""
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    weights = ws.empty("weights", tuple(logits.shape), torch.float32, logits.device).copy_(logits)
    weights.sub_(weights.amax(dim=-1, keepdim=True))
    return weights.div_(t[:, None]).exp_()


def _keep_thresholds(weights: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
    """[B] smallest weight each row keeps after top-k, top-p and min-p (the top weight is exactly
    1, so min-p's threshold is ``min_p``); None when none filters."""
    threshold = batch.min_ps if batch.needs_min_p else None
    if batch.needs_top_k or batch.needs_top_p:
        top_kp = _top_k_top_p_thresholds(weights, batch)
        threshold = top_kp if threshold is None else torch.maximum(top_kp, threshold)
    return threshold


def _top_k_top_p_thresholds(weights: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B] weight of the last token top-k then top-p keep (0 for rows using neither), from one sort
    (a top-k when every such row has a k) of the rows that need it."""
    rows = batch.sort_rows
    sub = weights if rows is None else weights.index_select(0, rows)
    top_ks = batch.top_ks if rows is None else batch.top_ks.index_select(0, rows)
    top_ps = batch.top_ps if rows is None else batch.top_ps.index_select(0, rows)

    width = min(batch.sort_width or sub.shape[-1], sub.shape[-1])
    if width < sub.shape[-1]:
        sorted_w = sub.topk(width, dim=-1).values
    else:
        sorted_w = sub.sort(dim=-1, descending=True).values

    keep_count = top_ks.clamp(1, width)
    if batch.needs_top_p:
        in_top_k = torch.arange(width, device=sub.device)[None, :] < keep_count[:, None]
        kept = sorted_w * in_top_k
        cumulative = kept.cumsum(dim=-1)
        mass_before = F.pad(cumulative[:, :-1], (1, 0))
        in_top_p = (mass_before < top_ps[:, None] * cumulative[:, -1:]) & in_top_k
        # top_p = 1 keeps everything: a float cumsum could otherwise drop a tiny tail. The top
        # token always stays (a top_p that is 0 in float32 would otherwise keep none).
        keep_count = torch.where(top_ps >= 1.0, keep_count, in_top_p.sum(dim=-1).clamp_min(1))
    threshold = sorted_w.gather(1, (keep_count - 1)[:, None]).squeeze(1)

    if rows is None:
        return threshold
    return torch.zeros_like(batch.temperatures).index_copy_(0, rows, threshold)
