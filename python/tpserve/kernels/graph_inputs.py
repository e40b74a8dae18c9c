"""One kernel that puts a decode graph's uploaded inputs in place (``engine/cuda_graph.py``): the token ids,
a placeholder -(r + 1) replaced by row r of the previous step's samples (overlap scheduling plans a step
before it knows them), the positions and KV slots, and where the graph's attention reads a dense page table
(the Triton and XQA decode kernels) that table's rows and the lengths.

The inputs arrive packed in one int32 buffer (``pack``), uploaded on a side stream while the previous graph
runs; this kernel is then the only work between the sampler and the next graph replay. Program r copies row r.
``install_reference`` does the same with torch operations (the CPU check and the fallback).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from tpserve.forward import resolve_future_tokens

# Offsets in the packed buffer are multiples of 4 int32 (16 bytes): Triton compiles a variant per pointer alignment.
_ALIGN = 4
_TABLE_BLOCK = 128  # one block size for every table width: no compile as sequences grow


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _offsets(size: int, width: int) -> tuple[int, int, int]:
    """Where the lengths and the table start in ``pack``'s buffer, and its length (int32 words)."""
    lens_at = _aligned(6 * size)
    table_at = lens_at + _aligned(size)
    return lens_at, table_at, (table_at + size * width if width else lens_at)


def packed_words(size: int, width: int) -> int:
    """The length of ``pack``'s buffer for ``size`` rows and a table ``width`` pages wide (0: none)."""
    return _offsets(size, width)[2]


def pack(tokens: np.ndarray, table: np.ndarray | None, lens: np.ndarray | None) -> np.ndarray:
    """One int32 buffer of the [3, B] int64 token rows (ids, positions, slots), then the [B] lengths and the
    [B, W] page table when given."""
    size = tokens.shape[1]
    width = 0 if table is None else table.shape[1]
    lens_at, table_at, words = _offsets(size, width)
    out = np.zeros(words, dtype=np.int32)
    out[: 6 * size].view(np.int64)[:] = tokens.reshape(-1)
    if table is not None:
        out[lens_at : lens_at + size] = lens
        out[table_at:] = table.reshape(-1)
    return out


def _views(packed: torch.Tensor, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token rows [3, size] int64, the lengths [size] and the table [size, width] of a packed buffer."""
    lens_at, table_at, _ = _offsets(size, width)
    tokens = packed[: 6 * size].view(torch.int64).view(3, size)
    return tokens, packed[lens_at : lens_at + size], packed[table_at : table_at + size * width].view(size, width)


def install_reference(
    packed: torch.Tensor, size: int, previous: torch.Tensor | None, tokens: torch.Tensor,
    table: torch.Tensor | None = None, lens: torch.Tensor | None = None, width: int = 0,
) -> None:
    """``install`` in torch operations."""
    staged, staged_lens, staged_table = _views(packed, size, width)
    ids = staged[0] if previous is None else resolve_future_tokens(staged[0], previous.to(torch.int64))
    tokens[0, :size].copy_(ids)
    tokens[1:3, :size].copy_(staged[1:3])
    if table is not None:
        lens[:size].copy_(staged_lens)
        table[:size, :width].copy_(staged_table)


def install(
    packed: torch.Tensor, size: int, previous: torch.Tensor | None, tokens: torch.Tensor,
    table: torch.Tensor | None = None, lens: torch.Tensor | None = None, width: int = 0,
) -> None:
    """Copy a ``pack``-ed device buffer of ``size`` rows into the graph's ``tokens`` [3, >= size] int64 and,
    with ``table``, its page ``table`` [>= size, >= width] and ``lens`` [>= size] (int32), in one kernel;
    ``previous``: the last step's samples, which the placeholders name."""
    staged, staged_lens, staged_table = _views(packed, size, width)
    dummy = tokens  # any pointer: read only under a branch that is off
    prev = previous if previous is not None else dummy
    _install_kernel[(size,)](
        staged, prev, prev.numel() if previous is not None else 0, tokens, tokens.stride(0),
        staged_lens if table is not None else dummy, staged_table if table is not None else dummy,
        table if table is not None else dummy, table.stride(0) if table is not None else 0,
        lens if lens is not None else dummy, width, size,
        HAS_TABLE=table is not None, BLOCK=_TABLE_BLOCK,
    )


# Sizes and strides unspecialised: a new batch size or table width must not compile a variant mid-serving.
@triton.jit(do_not_specialize=["prev_count", "tokens_stride", "table_stride", "width", "size"])
def _install_kernel(
    staged_ptr, prev_ptr, prev_count, tokens_ptr, tokens_stride, staged_lens_ptr, staged_table_ptr,
    table_ptr, table_stride, lens_ptr, width, size, HAS_TABLE: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    ids = tl.load(staged_ptr + r)
    if prev_count > 0:
        source = tl.minimum(tl.maximum(-ids - 1, 0), prev_count - 1)
        ids = tl.where(ids < 0, tl.load(prev_ptr + source).to(tl.int64), ids)
    tl.store(tokens_ptr + r, ids)
    tl.store(tokens_ptr + tokens_stride + r, tl.load(staged_ptr + size + r))
    tl.store(tokens_ptr + 2 * tokens_stride + r, tl.load(staged_ptr + 2 * size + r))
    if HAS_TABLE:
        tl.store(lens_ptr + r, tl.load(staged_lens_ptr + r))
        src = staged_table_ptr + r.to(tl.int64) * width
        dst = table_ptr + r.to(tl.int64) * table_stride
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            tl.store(dst + cols, tl.load(src + cols, mask=cols < width), mask=cols < width)
