"""Per-request sampling parameters, shared by the offline API and the server messages."""

from __future__ import annotations

import math

import msgspec


MAX_LOGPROBS = 20
# Temperatures below this are greedy, as in vLLM: dividing logits by 1e-50 would overflow to inf
# (and the row would sample at random), while any temperature this small is an argmax anyway.
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick each next token and when to stop.

    temperature 0 (or below 1e-5) means greedy. top_k -1 (or 0) disables top-k. A request with a ``seed``
    samples the same tokens every time, whatever else is in its batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    stop: list[str] | None = None
    # None: no log-probabilities; n >= 0: each sampled token's log-probability under the model
    # (before temperature and filters) plus the n most likely tokens' at that position.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
