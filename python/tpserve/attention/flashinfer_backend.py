"""Paged attention through FlashInfer's prefill and decode wrappers (the CUDA default).

A step of one-token sequences runs a decode kernel: FlashInfer's decode wrapper, or one that reads
a dense page table where that is faster, XQA (``attention/xqa.py``) or Triton's
(``attention/triton_decode.py``; under ``auto`` up to a batch size, the wrapper above it). Any
other step runs the causal prefill wrapper for all, decodes included. Each CUDA graph batch size
has its own fixed-address decode wrapper (or dense table), re-planned before every replay with the
batch padded by one-token sequences on the scratch page 0.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from itertools import chain
from types import ModuleType

import numpy as np
import torch

from tpserve.attention import xqa
from tpserve.attention.page_table import TableDecodeKernel, TableMetadata, dense_page_table
from tpserve.attention.base import AttentionBackend
from tpserve.config import FLASHINFER_DTYPES
from tpserve.forward import SequenceInput, check_page_tables
from tpserve.kernels import optional_import
from tpserve.kvcache.pool import KVCachePool

WORKSPACE_BYTES = 256 * 1024 * 1024  # split-kv partial results; FlashInfer recommends >= 128 MiB

logger = logging.getLogger(__name__)


def import_flashinfer() -> ModuleType:
    try:
        return import_module("flashinfer")
    except ImportError as exc:
        raise RuntimeError(
            "the flashinfer attention backend needs the flashinfer-python package "
            "(pip install 'tpserve[gpu]'); use --attention-backend torch without it"
        ) from exc


def default_decode_tensor_cores(num_heads: int, num_kv_heads: int) -> bool:
    # The tensor-core (prefill-kernel) decode path pays once a KV head serves 4+ query heads.
    return num_heads // num_kv_heads >= 4


@dataclass
class PagedLayout:
    """FlashInfer's CSR page table of a batch, on the host (int32)."""

    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor  # [kv_indptr[-1]] page ids
    last_page_len: torch.Tensor  # [B] tokens in each sequence's last page, 1..page_size
    qo_indptr: torch.Tensor  # [B + 1] offsets of each sequence's new tokens


def paged_layout(seqs: list[SequenceInput], page_size: int, pad_to: int = 0) -> PagedLayout:
    """The page table of ``seqs``; with ``pad_to`` > len(seqs), extra one-token sequences whose
    only page is the scratch page 0 fill the batch up to ``pad_to``."""
    batch = len(seqs)
    pad = max(pad_to - batch, 0)
    extend = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=batch)
    seq_lens = extend + np.fromiter((s.prefix_len for s in seqs), dtype=np.int64, count=batch)
    num_pages = -(-seq_lens // page_size)
    check_page_tables(seqs, seq_lens, page_size)
    total_pages = int(num_pages.sum())
    indices = np.zeros(total_pages + pad, dtype=np.int32)  # padding rows use page 0
    indices[:total_pages] = np.fromiter(
        chain.from_iterable(s.page_table[:n] for s, n in zip(seqs, num_pages.tolist())),
        dtype=np.int32,
        count=total_pages,
    )
    indptr = np.zeros(batch + pad + 1, dtype=np.int32)
    indptr[1:] = np.cumsum(np.concatenate([num_pages, np.ones(pad, dtype=np.int64)]))
    last = np.ones(batch + pad, dtype=np.int32)
    last[:batch] = seq_lens - (num_pages - 1) * page_size
    qo_indptr = np.zeros(batch + pad + 1, dtype=np.int32)
    qo_indptr[1:] = np.cumsum(np.concatenate([extend, np.ones(pad, dtype=np.int64)]))
    return PagedLayout(
        torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last), torch.from_numpy(qo_indptr)
    )


class PinnedStaging:
    """A reusable pinned host buffer that a plan's index arrays are copied into first.

    FlashInfer uploads them with ``non_blocking=True``: from pageable memory that copy may wait for
    the step in flight, undoing overlap scheduling. Stage again only once the last staged copies
    have run (``FlashInferAttentionBackend._stage`` waits for that).
    """

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.int32)

    def stage(self, layout: PagedLayout) -> PagedLayout:
        return PagedLayout(*self.stage_arrays(layout.kv_indptr, layout.kv_indices, layout.last_page_len, layout.qo_indptr))

    def stage_arrays(self, *arrays: torch.Tensor) -> list[torch.Tensor]:
        """int32 ``arrays`` copied into the buffer, as views of their shapes."""
        total = sum(a.numel() for a in arrays)
        if self.buffer.numel() < total:
            # The caching host allocator keeps the old block until its queued copies are done.
            self.buffer = torch.empty(max(total, 2 * self.buffer.numel()), dtype=torch.int32, pin_memory=True)
        views, offset = [], 0
        for array in arrays:
            view = self.buffer[offset : offset + array.numel()].view(array.shape)
            view.copy_(array)
            views.append(view)
            offset += array.numel()
        return views


@dataclass
class FlashInferMetadata:
    wrapper: object | None  # the planned BatchDecode/BatchPrefill wrapper of the layers without a window (None: none)
    # by window: the wrappers planned for the sliding-window layers (FlashInfer fixes the window at plan time)
    windowed: dict[int, object] = field(default_factory=dict)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int = 0) -> torch.Tensor:
        wrapper = self.windowed[window] if window else self.wrapper
        return wrapper.run(q.contiguous(), (k_cache, v_cache))


def decode_kernel_choice(decode_kernel: str, fp8_pages: bool, auto_triton: Callable[[], bool]) -> str:
    """The decode kernel a backend builds for ``--decode-attention``: the one asked for; under
    ``auto``, "xqa" over FP8 pages (the wrapper where XQA cannot run), "triton" over bf16/fp16
    pages where ``auto_triton()``, else "flashinfer" (the decode wrapper)."""
    if decode_kernel != "auto":
        return decode_kernel
    if fp8_pages:
        return "xqa"
    return "triton" if auto_triton() else "flashinfer"


class FlashInferAttentionBackend(AttentionBackend):
    supports_cuda_graphs = True
    rows_per_sequence = 1  # the most one-token rows a sequence has in a decode step (create_backend's)

    def __init__(
        self,
        pool: KVCachePool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        fused_rope_store: bool = False,
        decode_tensor_cores: bool | None = None,
        decode_kernel: str = "auto",
        scale: float | None = None,
        layer_windows: tuple[int, ...] = (),
        softcap: float | None = None,
        rows_per_sequence: int = 1,
    ) -> None:
        super().__init__(pool, num_heads, num_kv_heads, head_dim, fused_rope_store, scale, layer_windows, softcap)
        self.rows_per_sequence = rows_per_sequence
        if device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend needs a CUDA device, got {device}")
        self.dtype = pool.compute_dtype  # of q and the output; the cache's is pool.dtype
        if self.dtype not in FLASHINFER_DTYPES:
            raise ValueError(f"the flashinfer attention backend supports bfloat16 and float16, not {self.dtype}")
        self.flashinfer = import_flashinfer()
        self.device = device
        self.decode_tensor_cores = (
            default_decode_tensor_cores(num_heads, num_kv_heads) if decode_tensor_cores is None else decode_tensor_cores
        )
        # Shared by every wrapper: only one of them runs at a time.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # An FP8 cache under bf16/fp16 queries: fa2 (FA3's kernels take FP8 q too or neither).
        prefill_backend = "fa2" if pool.dtype != pool.compute_dtype else "auto"
        # Keyed by sliding window (0: none): each window's layers run a wrapper planned for it.
        self.prefill_wrappers = {
            window: self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=prefill_backend)
            for window in self.windows
        }
        self.decode_wrappers = {
            window: self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores
            )
            for window in self.windows
        }
        # When set, decode steps of up to table_decode_max_batch sequences run it (larger: the wrapper).
        self.table_decode, self.table_decode_max_batch = self._make_table_decode(decode_kernel)
        self._graph_table: tuple[torch.Tensor, torch.Tensor] | None = None  # dense page table and lengths
        self._graph_indices: torch.Tensor | None = None  # page ids of graph batches, shared by size
        self._planned: torch.cuda.Event | None = None  # the last plan's copies are enqueued
        self._staging = PinnedStaging()

    def _make_table_decode(self, decode_kernel: str) -> tuple[TableDecodeKernel | None, int]:
        """The decode kernel over the dense page table and the largest batch it takes: XQA when asked
        for or under ``auto`` over an FP8 cache (``attention/xqa.py``); Triton's kernel when asked for
        or under ``auto`` over bf16/fp16 pages on Hopper up to ``triton_decode.AUTO_MAX_BATCH``;
        (None, 0) for FlashInfer's decode wrapper."""
        choice = decode_kernel_choice(decode_kernel, self.pool.fp8, self._auto_triton)
        if choice == "flashinfer":
            return None, 0
        if choice == "triton":
            from tpserve.attention.triton_decode import AUTO_MAX_BATCH

            return self._make_triton_decode(), AUTO_MAX_BATCH if decode_kernel == "auto" else sys.maxsize
        reason = xqa.attention_unsupported_reason(any(self.layer_windows), self.softcap)
        if reason is None:
            reason = xqa.unsupported_reason(
                self.flashinfer, self.device, self.pool.page_size, self.head_dim, self.num_heads, self.num_kv_heads
            )
        if reason is None:
            try:
                xqa_decode = xqa.XqaDecode(self.pool, self.num_heads, self.num_kv_heads, self.head_dim, self.scale,
                                           self.device, pdl=self.rows_per_sequence == 1)
                return xqa_decode, sys.maxsize
            except Exception as exc:  # noqa: BLE001 -- e.g. no nvcc to build the kernel: auto falls back
                reason = f"building the XQA kernel failed ({type(exc).__name__}: {exc})"
                if decode_kernel == "auto":
                    logger.warning("%s; decoding with FlashInfer's decode wrapper", reason)
        if decode_kernel == "xqa":
            raise ValueError(f"decode attention xqa: {reason}; use auto or flashinfer")
        return None, 0

    def _auto_triton(self) -> bool:
        """Whether ``auto`` decodes small batches with the Triton kernel: on Hopper, where it was
        measured faster (docs/benchmarks.md), for the layouts it takes."""
        if optional_import("triton") is None or torch.cuda.get_device_capability(self.device)[0] != 9:
            return False
        from tpserve.attention import triton_decode

        return triton_decode.unsupported_reason(self.head_dim, self.num_heads, self.num_kv_heads, False) is None

    def _make_triton_decode(self) -> TableDecodeKernel:
        from tpserve.attention import triton_decode

        reason = triton_decode.unsupported_reason(self.head_dim, self.num_heads, self.num_kv_heads, self.pool.fp8)
        if reason is not None:
            raise ValueError(f"decode attention triton: {reason}; use auto or flashinfer")
        return triton_decode.TritonDecode(self.num_heads, self.num_kv_heads, self.scale, self.device,
                                          softcap=self.softcap, fresh_tokens=self.rows_per_sequence,
                                          **triton_decode.config_from_env())

    def describe(self) -> str:
        pages = "FP8" if self.pool.fp8 else str(self.pool.dtype).removeprefix("torch.")
        decode = "FlashInfer's decode wrapper"
        if self.table_decode is not None:
            limit = self.table_decode_max_batch
            decode = self.table_decode.name + ("" if limit == sys.maxsize else f" up to batch {limit}, then {decode}")
        return f"FlashInfer attention over {pages} pages (decode: {decode}){self.describe_scores()}"

    def _use_table(self, batch_size: int) -> bool:
        return self.table_decode is not None and batch_size <= self.table_decode_max_batch

    def _wait_for_last_plan(self) -> None:
        """The previous plan's queued copies may still read the staging buffer (and FlashInfer's
        pinned ones): wait for them, not for the step, so overlap scheduling keeps planning ahead."""
        if self._planned is not None:
            self._planned.synchronize()

    def _stage(self, layout: PagedLayout) -> PagedLayout:
        self._wait_for_last_plan()
        return self._staging.stage(layout)

    def _stage_table(self, seqs: list[SequenceInput], pad_to: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        table, lens = dense_page_table(seqs, self.pool.page_size, pad_to)
        self._wait_for_last_plan()
        staged_table, staged_lens = self._staging.stage_arrays(torch.from_numpy(table), torch.from_numpy(lens))
        return staged_table, staged_lens

    def _mark_planned(self) -> None:
        """Record that this plan's copies are enqueued (``_stage`` waits for them next time)."""
        self._planned = torch.cuda.Event()
        self._planned.record()

    def prepare(self, seqs: list[SequenceInput], device: torch.device) -> FlashInferMetadata | TableMetadata:
        decode = all(len(s.token_ids) == 1 for s in seqs)
        if decode and self._use_table(len(seqs)):
            table, lens = self._stage_table(seqs)
            meta = TableMetadata(
                self.table_decode, table.to(self.device, non_blocking=True), lens.to(self.device, non_blocking=True)
            )
            self._mark_planned()
            return meta
        layout = self._stage(paged_layout(seqs, self.pool.page_size))
        wrappers = self.decode_wrappers if decode else self.prefill_wrappers
        for window, wrapper in wrappers.items():
            if decode:
                self._plan_decode(wrapper, layout, window)
            else:
                wrapper.plan(
                    layout.qo_indptr,
                    layout.kv_indptr,
                    layout.kv_indices,
                    layout.last_page_len,
                    self.num_heads,
                    self.num_kv_heads,
                    self.head_dim,
                    self.pool.page_size,
                    causal=True,
                    **self._plan_options(window),
                )
        self._mark_planned()
        return FlashInferMetadata(wrappers.get(0), {w: wrapper for w, wrapper in wrappers.items() if w})

    def _plan_decode(self, wrapper: object, layout: PagedLayout, window: int = 0) -> None:
        wrapper.plan(
            layout.kv_indptr,
            layout.kv_indices,
            layout.last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.pool.page_size,
            **self._plan_options(window),
        )

    def _plan_options(self, window: int) -> dict[str, object]:
        """What every plan call takes beside the page table: the scale, dtypes, window and soft-cap."""
        return dict(
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.pool.dtype,
            window_left=window - 1,  # FlashInfer's window excludes the query's own token; -1: none
            # cap * tanh(sm_scale * q.k / cap): FlashInfer applies sm_scale before the cap, as transformers does
            logits_soft_cap=self.softcap,
        )

    def attend(self, layer: int, q: torch.Tensor, meta: FlashInferMetadata | TableMetadata) -> torch.Tensor:
        return meta.attend(q, self.pool.k[layer], self.pool.v[layer], self.window(layer))

    # ---- CUDA graphs (decode only) ----
    def cuda_graph_metadata(self, batch_size: int, max_pages_per_seq: int) -> FlashInferMetadata | TableMetadata:
        """A decode wrapper (or a dense table) with fixed-address buffers for one graph batch size."""
        if self._use_table(batch_size):
            # One table for every size, as the page-id buffer below: one graph replays at a time.
            if self._graph_table is None:
                self._graph_table = (
                    torch.zeros((batch_size, max_pages_per_seq), dtype=torch.int32, device=self.device),
                    torch.ones(batch_size, dtype=torch.int32, device=self.device),
                )
            table, lens = self._graph_table
            if table.shape[0] < batch_size:
                raise RuntimeError("capture CUDA graphs largest batch first (the dense page table is shared)")
            return TableMetadata(self.table_decode, table[:batch_size], lens[:batch_size])
        capacity = batch_size * max_pages_per_seq
        if self._graph_indices is None or self._graph_indices.numel() < capacity:
            if self._graph_indices is not None:
                raise RuntimeError("capture CUDA graphs largest batch first (the page-id buffer is shared)")
            self._graph_indices = torch.zeros(capacity, dtype=torch.int32, device=self.device)
        # One wrapper a window; they share the page table's buffers, which each plan fills alike.
        indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device)
        last_page_len = torch.ones(batch_size, dtype=torch.int32, device=self.device)
        wrappers = {
            window: self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=last_page_len,
            )
            for window in self.windows
        }
        return FlashInferMetadata(wrappers.get(0), {w: wrapper for w, wrapper in wrappers.items() if w})

    @torch.inference_mode()  # the buffers were made during capture, in inference mode
    def plan_cuda_graph(
        self, seqs: list[SequenceInput], meta: FlashInferMetadata | TableMetadata, batch_size: int
    ) -> None:
        if isinstance(meta, TableMetadata):
            table, lens = self._stage_table(seqs, pad_to=batch_size)
            # Columns past this step's longest sequence keep stale ids that no length reaches.
            meta.page_table[:, : table.shape[1]].copy_(table, non_blocking=True)
            meta.seq_lens.copy_(lens, non_blocking=True)
            self._mark_planned()
            return
        layout = self._stage(paged_layout(seqs, self.pool.page_size, pad_to=batch_size))
        # A graph wrapper copies host page ids into its fixed buffer with a blocking copy (a
        # stream sync); handing it that buffer, already filled asynchronously, skips the copy.
        indices = self._graph_indices[: layout.kv_indices.numel()]
        indices.copy_(layout.kv_indices, non_blocking=True)
        layout.kv_indices = indices
        for window, wrapper in ((0, meta.wrapper), *meta.windowed.items()):
            if wrapper is not None:
                self._plan_decode(wrapper, layout, window)
        self._mark_planned()
