"""A layer's LoRA adapters (``models/adapters.py`` loads them) and a step's choice of them per token."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRABatch:
    """A step's adapters: each token's slot (``ids`` [T] on the device) and the slots other than 0 among them."""

    ids: torch.Tensor
    slots: tuple[int, ...]


class LoRAWeights:
    """One layer's adapters: ``a`` [slots, parts x max_rank, in], ``b`` [slots, out, parts x max_rank] (scaled).
    The tensors are allocated once; loading an adapter copies into its slot and ``filled`` names the slots holding
    one that adapts this layer (the others are zero and skipped)."""

    def __init__(self, slots: int, parts: int, max_rank: int, in_features: int, out_features: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.max_rank = max_rank
        self.a = torch.zeros(slots, parts * max_rank, in_features, device=device, dtype=dtype)
        self.b = torch.zeros(slots, out_features, parts * max_rank, device=device, dtype=dtype)
        self.filled: set[int] = set()

    def clear(self, slot: int) -> None:
        """Zero a slot (its adapter unloaded, or a load of it failed part-way)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.filled.discard(slot)

    def adapts(self, batch: LoRABatch) -> bool:
        return not self.filled.isdisjoint(batch.slots)

    def delta(self, x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """The adapters' sum over ``x`` [T, in]: each token through its own slot's (a token of slot 0 adds 0).
        Each slot masks the whole input rather than gathering its rows: a gather needs the rows' count on the host,
        a sync per layer, and the masked product is rank-sized (``max_rank`` columns), small beside the layer's.
        Only where ``adapts(batch)``: some slot of the batch is filled."""
        out = None
        for slot in sorted(self.filled.intersection(batch.slots)):
            mine = x * (batch.ids == slot).to(x.dtype)[:, None]
            part = (mine @ self.a[slot].T) @ self.b[slot].T
            out = part if out is None else out + part
        return out
