"""Vocabulary-parallel embedding and LM head. The vocabulary is split by ceiling division; the
last rank's slice is padded with zero rows (the all-gather needs equal shapes) cut off after."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.distributed.comm import Communicator
from tpserve.distributed.info import get_tp_info
from tpserve.kernels import gemv
from tpserve.layers.linear import PendingNorm, ReplicatedWeights


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, embedding_dim: int, comm: Communicator) -> None:
        super().__init__()
        tp = get_tp_info()
        self.comm = comm
        self.vocab_size = vocab_size
        rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = min(tp.rank * rows_per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + rows_per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(rows_per_rank, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(y)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != self.weight.shape[1]:
            raise ValueError(
                f"vocabulary weight: expected shape ({self.vocab_size}, {self.weight.shape[1]}), "
                f"got {tuple(loaded.shape)}"
            )
        n = self.vocab_end - self.vocab_start
        self.weight.data[:n].copy_(loaded[self.vocab_start : self.vocab_end])
        self.weight.data[n:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """Each rank's slice of the logits, all-gathered; ``tied`` shares the embedding's weight."""

    def __init__(
        self, vocab_size: int, hidden_size: int, comm: Communicator, tied: VocabParallelEmbedding | None = None
    ) -> None:
        super().__init__(vocab_size, hidden_size, comm)
        if tied is not None:
            self.weight = tied.weight
        self.bf16_gemv = False  # the logits through the CUDA GEMV at one or two tokens (set at load)

    def finish_loading(self, dtype: torch.dtype) -> None:
        self.bf16_gemv = gemv.bf16_gemv_enabled(self.weight.data)

    def forward(self, hidden: torch.Tensor | PendingNorm) -> torch.Tensor:
        if isinstance(hidden, PendingNorm):
            residual = hidden.residual
            if self.bf16_gemv and gemv.fuse_norm_enabled(residual):
                # the final norm inside the GEMV: one kernel fewer at the end of a one-token step
                logits = gemv.gemv(residual, self.weight, norm=(hidden.norm.weight, hidden.norm.eps))
                return self._gather(logits)
            hidden = hidden.value()
        return self._gather(gemv.linear(hidden, self.weight, self.bf16_gemv))

    def _gather(self, logits: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size > 1:
            logits = self.comm.all_gather(logits)
        return logits[..., : self.vocab_size]


class ScoreHead(ReplicatedWeights):
    """A sequence classifier's head (transformers' ``score``: a linear layer without bias): its class logits from the
    last token's final hidden state. Every rank holds it whole (it has a few rows), so its logits need no gather."""

    def __init__(self, num_labels: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)
