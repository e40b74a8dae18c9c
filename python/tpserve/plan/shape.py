"""What a model costs per rank at a TP size: the bytes it holds and reads, the FLOPs it does,
and the KV bytes per token, counted the way tpserve's parallel layers split it.

With FP8 weights (an FP8 checkpoint, or ``--quantization fp8``, on a GPU that keeps them FP8) the
decoder layers' linear weights are 1 byte each plus a float32 scale per block; embeddings, the
LM head, norms and biases stay in the serving dtype, as tpserve keeps them. An FP8 KV cache
(``--kv-cache-dtype fp8_e4m3``) holds 1 byte per element."""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    config: ModelConfig
    dtype_bytes: int
    fp8_block: tuple[int, int] | None = None  # FP8 linear weights with a scale per block of this shape
    kv_dtype_bytes: int | None = None  # bytes per KV-cache element; None: the serving dtype's

    @property
    def linear_bytes(self) -> float:
        """Bytes per decoder-layer linear weight."""
        if self.fp8_block is None:
            return self.dtype_bytes
        return 1 + 4 / (self.fp8_block[0] * self.fp8_block[1])

    @property
    def layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden(self) -> int:
        return self.config.hidden_size

    def kv_heads_per_rank(self, tp: int) -> int:
        """Each rank keeps kv/tp heads, or one replicated head when tp exceeds them."""
        return max(1, self.config.num_key_value_heads // tp)

    @property
    def moe_layers(self) -> int:
        moe = self.config.moe
        return 0 if moe is None else len(moe.layers)

    def attention_params(self, tp: int = 1) -> int:
        """One rank's share of one decoder layer's q/k/v/o weights."""
        c = self.config
        heads = c.num_attention_heads // tp
        return c.hidden_size * (heads + 2 * self.kv_heads_per_rank(tp)) * c.head_dim + heads * c.head_dim * c.hidden_size

    def dense_mlp_params(self, tp: int = 1) -> int:
        return 3 * self.hidden * (self.config.intermediate_size // tp)

    def expert_params(self, tp: int = 1) -> int:
        """One expert's gate/up/down on a rank: every rank holds a slice of every expert."""
        moe = self.config.moe
        return 0 if moe is None else 3 * self.hidden * (moe.intermediate_size // tp)

    def router_params(self) -> int:
        """Every rank holds a sparse layer's whole router."""
        moe = self.config.moe
        return 0 if moe is None else moe.num_experts * self.hidden

    def touched_experts(self, tokens: int) -> float:
        """Expected distinct experts a sparse layer reads for ``tokens`` tokens under uniform routing
        (as benchmarks/roofline.py: trained routers are less even, so this reads conservatively many)."""
        moe = self.config.moe
        if moe is None or tokens <= 0:
            return 0.0
        return moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** tokens)

    def layers_linear_params(self, tp: int = 1, experts: float | None = None) -> float:
        """The decoder layers' linear weights on a rank: attention, dense MLPs, routers and
        ``experts`` experts per sparse layer (None: all of them)."""
        moe = self.config.moe
        per_sparse = 0.0
        if moe is not None:
            per_sparse = self.router_params() + (moe.num_experts if experts is None else experts) * self.expert_params(tp)
        dense = self.layers - self.moe_layers
        return self.layers * self.attention_params(tp) + dense * self.dense_mlp_params(tp) + self.moe_layers * per_sparse

    def layer_small_params(self, tp: int = 1) -> int:
        """Norms and biases: every rank keeps its own (norms whole, biases its slice)."""
        c = self.config
        norms = 2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)
        bias = (c.num_attention_heads // tp + 2 * self.kv_heads_per_rank(tp)) * c.head_dim if c.qkv_bias else 0
        return norms + bias

    def vocab_rows(self, tp: int = 1) -> int:
        return -(-self.config.vocab_size // tp)  # the last rank's slice is padded

    def params_per_rank(self, tp: int = 1) -> int:
        c = self.config
        tables = (1 if c.tie_word_embeddings else 2) * self.vocab_rows(tp) * c.hidden_size
        return int(self.layers_linear_params(tp)) + self.layers * self.layer_small_params(tp) + tables + c.hidden_size

    def params(self) -> int:
        """The whole model's parameters (TP 1)."""
        return self.params_per_rank(1)

    def weight_bytes_per_rank(self, tp: int) -> float:
        linear = self.layers_linear_params(tp)
        return linear * self.linear_bytes + (self.params_per_rank(tp) - linear) * self.dtype_bytes

    def decode_read_bytes(self, tp: int, batch: int) -> float:
        """Weight bytes one step over ``batch`` tokens reads on a rank: every layer's weights once
        (of a sparse layer, the router and the experts the tokens touch) and the LM head; an untied
        input embedding only for the batch's rows."""
        c = self.config
        head = self.vocab_rows(tp) * c.hidden_size
        embed = 0 if c.tie_word_embeddings else min(batch, self.vocab_rows(tp)) * c.hidden_size
        linear = self.layers_linear_params(tp, self.touched_experts(batch))
        return linear * self.linear_bytes + (self.layers * self.layer_small_params(tp) + head + embed) * self.dtype_bytes

    def linear_flops(self, tp: int, tokens: int, last_tokens: int) -> float:
        """Matmul FLOPs of the decoder layers over ``tokens`` (top-k experts each) and of the LM
        head over the ``last_tokens`` that sample, on one rank."""
        active = self.layers_linear_params(tp, self.config.moe.top_k if self.config.moe else 0)
        head = self.vocab_rows(tp) * self.hidden
        return 2.0 * (active * tokens + head * last_tokens)

    def attention_flops(self, tp: int, pairs: float) -> float:
        """QK^T and PV over ``pairs`` (query, key) pairs, on one rank."""
        heads = self.config.num_attention_heads // tp
        return 4.0 * self.layers * heads * self.config.head_dim * pairs

    def kv_bytes_per_token(self, tp: int, element_bytes: float | None = None) -> float:
        """One rank's K and V bytes for one token over every layer (``element_bytes``: count each
        element as that many bytes instead of the cache's own)."""
        if element_bytes is None:
            element_bytes = self.dtype_bytes if self.kv_dtype_bytes is None else self.kv_dtype_bytes
        return 2 * self.layers * self.kv_heads_per_rank(tp) * self.config.head_dim * element_bytes
