"""CUDA graphs for decode steps: captured once per batch size at start-up, replayed for every
decode batch (padded up to the next captured size) to remove the launch gaps of its many kernels.

Padding rows carry token 0 at position 0 and write their k/v to the scratch page 0, which the pool
never hands out. Every graph reads the same static buffers and the attention backend's
fixed-address metadata. A step's token rows (and, where attention reads a dense page table, its
rows and lengths) are uploaded on a side stream while the previous graph runs and put in place by
one kernel before the replay (``engine/side_copies.py``); other metadata is refilled by the
backend's ``plan_cuda_graph``.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tpserve.attention.base import AttentionBackend
from tpserve.attention.page_table import TableMetadata, dense_page_table
from tpserve.engine.batch import build_host_batch
from tpserve.engine.side_copies import SideCopies
from tpserve.forward import ForwardContext, ForwardInputs, SequenceInput
from tpserve.models.decoder import CausalLM

logger = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch_size`` (which is always included)."""
    if max_batch_size < 1:
        return []
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 8))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [batch_size, vocab], overwritten by every replay
    attn_meta: object


class CUDAGraphRunner:
    def __init__(
        self, model: CausalLM, attention: AttentionBackend, page_size: int, max_model_len: int, max_batch_size: int,
        device: torch.device, copies: SideCopies,
    ) -> None:
        if not attention.supports_cuda_graphs:
            raise ValueError(f"{type(attention).__name__} does not support CUDA graphs")
        self.model = model
        self.attention = attention
        self.page_size = page_size
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1] if self.sizes else 0
        self.device = device
        self.copies = copies
        from tpserve.kernels import graph_inputs, use_triton  # here: triton only where graphs run

        self._graph_inputs = graph_inputs
        self._install = graph_inputs.install if use_triton(device) else graph_inputs.install_reference
        # rows: token ids, positions, KV slots (zeros: scratch-page writes); an even row length keeps
        # every row 16-byte aligned for the Triton kernels
        self.tokens = torch.zeros((3, self.max_batch_size + self.max_batch_size % 2), dtype=torch.int64, device=device)
        self.graphs: dict[int, _Graph] = {}

    def can_run(self, seqs: list[SequenceInput]) -> bool:
        return 0 < len(seqs) <= self.max_batch_size and all(
            len(s.token_ids) == 1 and not s.extra_logits and not s.pooled and not s.lora for s in seqs
        )

    def _inputs(self, batch_size: int, attn_meta: object) -> ForwardInputs:
        return ForwardInputs(
            input_ids=self.tokens[0, :batch_size],
            positions=self.tokens[1, :batch_size],
            out_slots=self.tokens[2, :batch_size],
            last_indices=None,  # one token a sequence: every row goes through the LM head
            attn=attn_meta,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        # Largest first: smaller graphs then reuse the pool's memory.
        for size in reversed(self.sizes):
            meta = self.attention.cuda_graph_metadata(size, self.max_pages_per_seq)
            self.attention.plan_cuda_graph([], meta, size)  # all padding: scratch page only
            ctx = ForwardContext(self._inputs(size, meta), self.attention)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up outside the graph (lazy inits, autotuning)
                    self.model(ctx)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = self.model(ctx)
            self.graphs[size] = _Graph(graph, logits, meta)
        self.copies.reserve(max(  # the largest step's inputs (a dense table only where attention reads one)
            self._graph_inputs.packed_words(size, self.max_pages_per_seq if isinstance(g.attn_meta, TableMetadata) else 0)
            for size, g in self.graphs.items()
        ))
        self._warm_up_install()
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        sizes = f"{self.sizes[:5]}...{self.sizes[-1]}" if len(self.sizes) > 6 else str(self.sizes)
        logger.info(
            "captured %d CUDA graphs (batch sizes %s) in %.1f s using %.0f MiB",
            len(self.sizes), sizes, time.perf_counter() - start, used / 2**20,
        )

    def _warm_up_install(self) -> None:
        """Compile the install kernel now (a variant with a dense page table, one without), not at the
        first decode step; it writes one padding row's inputs, as captured."""
        graph_inputs = self._graph_inputs
        if self._install is not graph_inputs.install:
            return
        with_table = {isinstance(g.attn_meta, TableMetadata): g for g in self.graphs.values()}
        for has_table, graph in with_table.items():
            rows = np.zeros((3, 1), dtype=np.int64)
            table, lens = (np.zeros((1, 1), dtype=np.int32), np.ones(1, dtype=np.int32)) if has_table else (None, None)
            packed = torch.from_numpy(graph_inputs.pack(rows, table, lens)).to(self.device)
            dest = (graph.attn_meta.page_table, graph.attn_meta.seq_lens) if has_table else (None, None)
            previous = torch.zeros(1, dtype=torch.int64, device=self.device)
            graph_inputs.install(packed, 1, previous, self.tokens, *dest, 0 if table is None else 1)

    @torch.inference_mode()
    def run(self, seqs: list[SequenceInput], previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """[len(seqs), vocab] logits of a decode batch, valid until the next replay (see ``Engine.forward``)."""
        return self.prepare(seqs)(previous_tokens)

    @torch.inference_mode()
    def prepare(self, seqs: list[SequenceInput]) -> Callable[[torch.Tensor | None], torch.Tensor]:
        """Upload the inputs of ``seqs`` (and plan attention) while the previous graph runs; the returned
        function installs them, resolving the placeholder tokens, and replays. Nothing else may replay in
        between (the inputs are shared)."""
        batch = len(seqs)
        size = self.sizes[bisect_left(self.sizes, batch)]
        graph = self.graphs[size]
        host = build_host_batch(seqs, self.page_size)
        rows = np.zeros((3, size), dtype=np.int64)
        rows[:, :batch] = host.tokens
        meta = graph.attn_meta
        table = lens = None
        if isinstance(meta, TableMetadata):
            table, lens = dense_page_table(seqs, self.page_size, pad_to=size)
            if table.shape[1] > meta.page_table.shape[1]:
                raise ValueError(f"a sequence of {int(lens.max())} tokens is longer than the graphs' "
                                 f"{meta.page_table.shape[1]} pages of {self.page_size}")
        else:
            self.attention.plan_cuda_graph(seqs, meta, size)
        packed, slot = self.copies.upload(self._graph_inputs.pack(rows, table, lens))
        width = 0 if table is None else table.shape[1]
        dest = (meta.page_table, meta.seq_lens) if table is not None else (None, None)

        def replay(previous_tokens: torch.Tensor | None) -> torch.Tensor:
            self.copies.wait(slot)
            self._install(packed, size, previous_tokens, self.tokens, *dest, width)
            self.copies.release(slot)
            graph.graph.replay()
            return graph.logits[:batch]

        return replay
