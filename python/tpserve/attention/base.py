"""The attention backend interface: ``prepare`` builds a step's metadata once (FlashInfer plans
there); each layer's ``forward`` (or ``forward_fused``) stores its new k/v and calls ``attend``."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tpserve.forward import SequenceInput
from tpserve.kvcache.pool import KVCachePool


class AttentionBackend(ABC):
    supports_cuda_graphs = False  # whether cuda_graph_metadata/plan_cuda_graph are implemented

    def __init__(
        self, pool: KVCachePool, num_heads: int, num_kv_heads: int, head_dim: int, fused_rope_store: bool = False,
        scale: float | None = None, layer_windows: tuple[int, ...] = (), softcap: float | None = None,
    ) -> None:
        """``scale``: the softmax scale (None: head_dim ** -0.5; Granite's attention_multiplier). ``layer_windows``:
        each layer's sliding window in tokens (0 or missing: the whole context; ``ModelConfig.layer_windows``).
        ``softcap``: the scores, after the softmax scale, become softcap * tanh(score / softcap) before the mask and
        softmax (Gemma's attn_logit_softcapping; None: none)."""
        if softcap is not None and not softcap > 0:
            raise ValueError(f"the attention logit soft-cap must be a positive number or None, got {softcap!r}")
        self.pool = pool
        self.fused_rope_store = fused_rope_store  # layers call forward_fused (chosen by the engine)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.layer_windows = layer_windows
        # the distinct windows the layers use (0: none), so a model whose layers all have one plans no full attention
        self.windows = sorted(set(layer_windows)) if layer_windows else [0]
        self.softcap = softcap

    def describe_scores(self) -> str:
        """The sliding windows in use and the soft-cap, for ``describe``."""
        windows = [w for w in self.windows if w]
        text = ", sliding window " + "/".join(map(str, windows)) if windows else ""
        return text + (f", logit soft-cap {self.softcap:g}" if self.softcap is not None else "")

    def window(self, layer: int) -> int:
        """Layer ``layer``'s window in tokens: it attends to its token and the window - 1 before it; 0: no window."""
        return self.layer_windows[layer] if layer < len(self.layer_windows) else 0

    def describe(self) -> str:
        """The kernels in use, for the engine's start-up log."""
        return type(self).__name__

    @abstractmethod
    def prepare(self, seqs: list[SequenceInput], device: torch.device) -> object:
        """Per-step metadata, built once and shared by all layers."""

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out_slots: torch.Tensor,
        meta: object,
    ) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]."""
        self.pool.store(layer, out_slots, k, v)
        return self.attend(layer, q, meta)

    def forward_fused(
        self,
        layer: int,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
        out_slots: torch.Tensor,
        meta: object,
    ) -> torch.Tensor:
        """``forward`` from the raw qkv [T, (Hq + 2 Hkv) * D]: q/k norm (``qk_norm`` = q weight,
        k weight, eps), rotary and the KV store in one Triton kernel, then ``attend``."""
        from tpserve.kernels.rope_store import norm_rope_store

        q_weight, k_weight, eps = qk_norm or (None, None, 0.0)
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        q = norm_rope_store(
            qkv, positions, cos_sin_cache, q_weight, k_weight, eps, k_cache, v_cache, out_slots,
            self.num_heads, self.num_kv_heads, self.head_dim,
        )
        return self.attend(layer, q, meta)

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, meta: object) -> torch.Tensor:
        """q [T, num_heads, head_dim] over layer ``layer``'s cache, this step's k/v already stored."""

    def cuda_graph_metadata(self, batch_size: int, max_pages_per_seq: int) -> object:
        """Metadata with fixed-address buffers for a decode graph of ``batch_size`` sequences."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def plan_cuda_graph(self, seqs: list[SequenceInput], meta: object, batch_size: int) -> None:
        """Fill ``meta`` (from cuda_graph_metadata) for ``seqs`` padded to ``batch_size``."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

