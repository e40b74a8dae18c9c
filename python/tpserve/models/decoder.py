"""The decoder of Qwen3, Qwen3-MoE, Qwen2/2.5, Qwen2-MoE, Llama 3.x, Mistral, Mixtral, OLMoE, Granite, Phi-3, Gemma 2
and Gemma 3 (ModelConfig switches), with the checkpoints' parameter names but q/k/v merged into ``qkv_proj``, gate/up
into ``gate_up_proj``.

At TP > 1 attention and MLP return this rank's partial sum: the add+RMSNorm after each all-reduces
it (``Communicator.all_reduce_add_rmsnorm``, in one kernel where it can). At TP 1, where the CUDA GEMV
runs at one token (``gemv.FUSE_NORM_MAX_TOKENS``), the add + RMSNorm rides in the GEMVs around it: o_proj and down_proj
(a MoE block's down kernel) add their output to the residual stream and return None, and qkv_proj, gate_up_proj and a MoE block (its router's
GEMV and its first expert kernel) take a ``PendingNorm`` that they norm as they read it (``add_and_norm``).

Gemma's sandwich norms (``sandwich_norms``) norm each sublayer's output before it joins the residual stream: that
output is all-reduced first (a norm is not linear), normed and added; the next norm then reads the residual whole."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.config import ModelConfig
from tpserve.distributed.comm import Communicator
from tpserve.distributed.info import get_tp_info
from tpserve.forward import ForwardContext
from tpserve.layers.embedding import ParallelLMHead, ScoreHead, VocabParallelEmbedding
from tpserve.layers.linear import PendingNorm, QKVParallelLinear, RowParallelLinear
from tpserve.layers.mlp import MLP
from tpserve.layers.moe import SparseMoeBlock
from tpserve.layers.norm import ProjectionNorm, RMSNorm
from tpserve.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, comm: Communicator) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, comm)
        self.comm = comm
        # q/k RMSNorms: per head (Qwen3), over the whole projections (OLMoE: ProjectionNorm), or none
        self.q_norm: RMSNorm | ProjectionNorm | None = None
        self.k_norm: RMSNorm | ProjectionNorm | None = None
        self.head_norm, self.projection_norm, self.clip_qkv = cfg.qk_norm, cfg.projection_qk_norm, cfg.clip_qkv
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps), RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        elif cfg.projection_qk_norm:
            copies = max(1, get_tp_info().size // cfg.num_key_value_heads)  # ranks holding each KV head
            self.q_norm = ProjectionNorm(self.qkv_proj.part("q"), cfg.rms_norm_eps)
            self.k_norm = ProjectionNorm(self.qkv_proj.part("k"), cfg.rms_norm_eps, copies)
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer

    def forward(
        self, x: torch.Tensor | PendingNorm, ctx: ForwardContext, add_to: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """This rank's partial sum of the output projection (not all-reduced), or None where it was
        added to ``add_to`` (``RowParallelLinear``)."""
        qkv = self.qkv_proj(x, ctx.lora)
        if self.projection_norm:
            qkv = self._norm_projections(qkv)
        if ctx.attention.fused_rope_store:
            out = self._fused_attention(qkv, ctx)
        else:
            q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            if self.head_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary[0](ctx.inputs.positions, q, k)
            out = ctx.attention.forward(self.layer_id, q, k, v, ctx.inputs.out_slots, ctx.inputs.attn)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim), reduce=False, add_to=add_to, lora=ctx.lora)

    def _norm_projections(self, qkv: torch.Tensor) -> torch.Tensor:
        """OLMoE's q and k RMSNorms over the whole projections: each rank's sums of squares, all-reduced in one
        collective at TP > 1; the merged qkv rebuilt, clamped to +-``clip_qkv`` where the config sets it."""
        q_norm, k_norm = self.q_norm, self.k_norm
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        sums = torch.stack([q_norm.sum_of_squares(q), k_norm.sum_of_squares(k)], dim=-1)
        sums = self.comm.all_reduce(sums)
        qkv = torch.cat([q_norm.normalize(q, sums[:, 0]), k_norm.normalize(k, sums[:, 1]), v], dim=-1)
        return qkv if self.clip_qkv is None else qkv.clamp_(-self.clip_qkv, self.clip_qkv)

    def _fused_attention(self, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.head_norm else None
        inputs, cos_sin = ctx.inputs, self.rotary[0].cos_sin_cache
        return ctx.attention.forward_fused(self.layer_id, qkv, inputs.positions, cos_sin, norm, inputs.out_slots, inputs.attn)


def add_and_norm(
    comm: Communicator, x: torch.Tensor | None, residual: torch.Tensor | None, norm: RMSNorm
) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
    """The residual add + RMSNorm before a sublayer: (its input, the new residual). ``residual`` None:
    ``x`` is the embedding; ``x`` None: the last sublayer has added its output to ``residual``; then the
    norm is left to the next GEMV (``PendingNorm``)."""
    if residual is None:
        return PendingNorm(x, norm), x
    if x is None:
        return PendingNorm(residual, norm), residual
    return comm.all_reduce_add_rmsnorm(x, residual, norm)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, comm: Communicator) -> None:
        super().__init__()
        self.comm = comm
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, rotary, comm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:  # Gemma's (post_attention_layernorm then norms the attention output)
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            SparseMoeBlock(cfg, comm) if cfg.is_moe_layer(layer_id)
            else MLP(cfg.hidden_size, cfg.intermediate_size, comm, cfg.hidden_act)
        )

    def forward(
        self, x: torch.Tensor | None, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``x``: the embedding (first layer: ``residual`` is None), the previous layer's MLP output as
        this rank's partial sum, or None where it was added to ``residual``; returns this layer's
        likewise, and the residual."""
        x, residual = add_and_norm(self.comm, x, residual, self.input_layernorm)
        if self.sandwich:
            return self._sandwich(x, residual, ctx)
        x = self.self_attn(x, ctx, add_to=residual)
        x, residual = add_and_norm(self.comm, x, residual, self.post_attention_layernorm)
        if isinstance(self.mlp, MLP):  # a MoE block is not adapted (models/adapters.py refuses such adapters)
            return self.mlp(x, reduce=False, add_to=residual, lora=ctx.lora), residual
        return self.mlp(x, reduce=False, add_to=residual), residual

    def _sandwich(
        self, x: torch.Tensor | PendingNorm, residual: torch.Tensor, ctx: ForwardContext
    ) -> tuple[None, torch.Tensor]:
        """Gemma's layer after its input norm: residual += post_attention_layernorm(attention), then
        residual += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(residual))), each sublayer's output
        all-reduced before its norm. Returns (None, the residual): the next layer's input norm reads it whole."""
        attended = self.comm.all_reduce(self.self_attn(x, ctx))
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(attended), residual)
        out = self.comm.all_reduce(self.mlp(x, reduce=False, lora=ctx.lora))
        return None, residual + self.post_feedforward_layernorm(out)


def embedding_multiplier(cfg: ModelConfig, dtype: torch.dtype) -> float:
    """Granite's as it is; Gemma's rounded to the compute dtype (transformers casts its normalizer so)."""
    if not cfg.embedding_multiplier_in_dtype:
        return cfg.embedding_multiplier
    return torch.tensor(cfg.embedding_multiplier, dtype=dtype).item()


class DecoderBody(nn.Module):
    def __init__(
        self, cfg: ModelConfig, rotary: RotaryEmbedding, comm: Communicator, local_rotary: RotaryEmbedding | None = None
    ) -> None:
        """``local_rotary``: that of ``cfg.local_layers`` (Gemma 3's sliding-window layers)."""
        super().__init__()
        self.comm = comm
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, local_rotary if i in cfg.local_layers and local_rotary else rotary, comm)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.config = cfg

    def forward(self, ctx: ForwardContext) -> torch.Tensor | PendingNorm:
        """The final hidden states, normed or (``PendingNorm``) with the final norm left to the LM head."""
        x = self.embed_tokens(ctx.inputs.input_ids)
        if self.config.embedding_multiplier != 1.0:  # Granite's, Gemma's
            x = x * embedding_multiplier(self.config, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        x, _ = add_and_norm(self.comm, x, residual, self.norm)
        return x


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Communicator, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_parameters, cfg.max_position_embeddings)
        self.local_rotary = None  # Gemma 3's sliding-window layers' (rope_local_base_freq, unscaled)
        if cfg.local_rope_parameters is not None:
            self.local_rotary = RotaryEmbedding(
                cfg.head_dim, max_positions, cfg.local_rope_parameters, cfg.max_position_embeddings
            )
        self.model = DecoderBody(cfg, self.rotary, comm, self.local_rotary)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, comm, tied=tied)
        self.score = ScoreHead(len(cfg.labels), cfg.hidden_size) if cfg.labels else None

    def build_rotary_caches(self, device: torch.device, dtype: torch.dtype) -> None:
        for rotary in (self.rotary, self.local_rotary):
            if rotary is not None:
                rotary.build_cache(device, dtype)

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """Logits [B, vocab] of each sequence's last new token (only those go through the head); the hidden states
        of ``inputs.pooled_rows`` among those rows go to ``ctx.pooled`` (a classifier's: their class logits)."""
        hidden = self.model(ctx)
        rows, pooled = ctx.inputs.last_indices, ctx.inputs.pooled_rows
        if rows is None and pooled is None:  # one token a sequence: the head may norm its input as it reads it
            return self._scaled(self.lm_head(hidden))
        head_in = hidden.value() if isinstance(hidden, PendingNorm) else hidden
        if rows is not None:
            head_in = head_in[rows]
        if pooled is not None:
            ctx.pooled = head_in[pooled] if self.score is None else self.score(head_in[pooled])
        return self._scaled(self.lm_head(head_in))

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """Granite's logits divided by logits_scaling, Gemma's soft-capped (final_logit_softcapping): after the head's
        all-gather, as transformers computes them."""
        scaling, cap = self.config.logits_scaling, self.config.final_logit_softcapping
        if scaling != 1.0:
            logits = logits / scaling
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
