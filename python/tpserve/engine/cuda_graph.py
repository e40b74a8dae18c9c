"""CUDA graphs for decode steps: captured once per batch size at start-up, replayed for every
decode batch (padded up to the next captured size) to remove the launch gaps of its many kernels.

Padding rows carry token 0 at position 0 and write their k/v to the scratch page 0, which the pool
never hands out. Every graph reads the same static buffers and the attention backend's
fixed-address metadata, which ``plan_cuda_graph`` refills before each replay.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tpserve.attention.base import AttentionBackend
from tpserve.engine.batch import build_host_batch, resolve_future_tokens
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
        device: torch.device,
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
        # rows: token ids, positions, KV slots (zeros: scratch-page writes), placeholder sources (see
        # prepare); an even row length keeps every row 16-byte aligned for the Triton kernels
        self.tokens = torch.zeros((4, self.max_batch_size + self.max_batch_size % 2), dtype=torch.int64, device=device)
        self.last_indices = torch.arange(self.max_batch_size, dtype=torch.int64, device=device)
        self.graphs: dict[int, _Graph] = {}

    def can_run(self, seqs: list[SequenceInput]) -> bool:
        return 0 < len(seqs) <= self.max_batch_size and all(len(s.token_ids) == 1 and not s.extra_logits for s in seqs)

    def _inputs(self, batch_size: int, attn_meta: object) -> ForwardInputs:
        return ForwardInputs(
            input_ids=self.tokens[0, :batch_size],
            positions=self.tokens[1, :batch_size],
            out_slots=self.tokens[2, :batch_size],
            last_indices=self.last_indices[:batch_size],
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
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        sizes = f"{self.sizes[:5]}...{self.sizes[-1]}" if len(self.sizes) > 6 else str(self.sizes)
        logger.info(
            "captured %d CUDA graphs (batch sizes %s) in %.1f s using %.0f MiB",
            len(self.sizes), sizes, time.perf_counter() - start, used / 2**20,
        )

    @torch.inference_mode()
    def run(self, seqs: list[SequenceInput], previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """[len(seqs), vocab] logits of a decode batch, valid until the next replay (see ``Engine.forward``)."""
        return self.prepare(seqs)(previous_tokens)

    @torch.inference_mode()
    def prepare(self, seqs: list[SequenceInput]) -> Callable[[torch.Tensor | None], torch.Tensor]:
        """Fill the static inputs and plan attention for ``seqs``; the returned function resolves the
        placeholder tokens and replays. Nothing else may replay in between (the inputs are shared)."""
        batch = len(seqs)
        size = self.sizes[bisect_left(self.sizes, batch)]
        graph = self.graphs[size]
        host = build_host_batch(seqs, self.page_size)
        staged = torch.zeros((4, size), dtype=torch.int64, pin_memory=True)
        rows = staged.numpy()
        rows[:3, :batch] = host.tokens
        # Row 3: where each placeholder's token is in the previous step's samples (resolved on the device)
        ids = host.tokens[0]
        all_futures = bool((ids < 0).all())
        rows[3, :batch] = -ids - 1
        self.tokens[:, :size].copy_(staged, non_blocking=True)
        self.attention.plan_cuda_graph(seqs, graph.attn_meta, size)
        sources = self.tokens[3, :batch]
        highest_source = int(rows[3, :batch].max())

        def replay(previous_tokens: torch.Tensor | None) -> torch.Tensor:
            if previous_tokens is not None:
                input_ids = self.tokens[0, :batch]
                if all_futures and highest_source < previous_tokens.numel() and previous_tokens.dtype == input_ids.dtype:
                    # a decode batch of placeholders only: one gather, not resolve_future_tokens' six kernels
                    torch.index_select(previous_tokens, 0, sources, out=input_ids)
                else:
                    input_ids.copy_(resolve_future_tokens(input_ids, previous_tokens))
            graph.graph.replay()
            return graph.logits[:batch]

        return replay
