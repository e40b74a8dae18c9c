"""Typed messages between processes (msgspec structs, sent over ZMQ).

Flow: API server -> tokenizer -> scheduler rank 0 (broadcast to other ranks) -> detokenizer
-> API server. Only rank 0 talks to the tokenizer and detokenizer.
"""

from __future__ import annotations

import msgspec

from tpserve.sampling_params import SamplingParams


# ---- into the scheduler (from tokenizers, the detokenizer or the API server) ----
class GenerateRequest(msgspec.Struct, tag="generate"):
    """A tokenized request. ``rid`` is unique per server; sampling params are final (seed set)."""

    rid: int
    input_ids: list[int]
    params: SamplingParams


class AbortRequest(msgspec.Struct, tag="abort"):
    """Client gone or stop string hit: free the request's KV pages now."""

    rid: int


class GrammarReady(msgspec.Struct, tag="grammar_ready"):
    """Rank 0's word that a request's grammar has compiled (every rank attaches it now) or, with ``timed_out``,
    that it took too long (every rank ends the request with an error now)."""

    rid: int
    timed_out: bool = False


class FlushCache(msgspec.Struct, tag="flush_cache"):
    pass


class GetStats(msgspec.Struct, tag="get_stats"):
    """Rank 0 answers with the current ``SchedulerStats`` (as it answers FlushCache)."""


class LoadLoRA(msgspec.Struct, tag="load_lora"):
    """Load the PEFT adapter at ``path`` as ``name`` into a free slot of every rank (of every replica); rank 0
    answers with a ``LoRAAnswer`` of ``rid`` (an id of the API server's, never a request's)."""

    rid: int
    name: str
    path: str


class UnloadLoRA(msgspec.Struct, tag="unload_lora"):
    """Unload adapter ``name``: requests admitted with it finish with it, new ones may not name it."""

    rid: int
    name: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


SchedulerInput = (GenerateRequest | AbortRequest | GrammarReady | FlushCache | GetStats | LoadLoRA | UnloadLoRA
                  | Shutdown)


# ---- out of scheduler rank 0 (to the detokenizer) ----
class TokenOutput(msgspec.Struct):
    """New tokens of one request from one step. finish_reason: None, "stop", "length", "abort",
    or "error" (then ``error`` says why, e.g. the request can never fit in the KV cache)."""

    rid: int
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    # Only for requests that asked for logprobs: one entry per token in token_ids.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    ranks: list[int] | None = None  # each token's rank in the vocabulary (1: most likely), as vLLM's Logprob.rank
    matched_stop: int | None = None  # the EOS or stop token id that ended it (finish "stop")
    # With its first token, for requests that asked for prompt log-probabilities: the prompt, and for
    # each prompt token after the first its log-probability and the most likely (id, log-probability) pairs.
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_ranks: list[int] | None = None  # each of those prompt tokens' rank in the vocabulary (1: most likely)
    # A pooled request's answer (finish "stop", no tokens): its last prompt token's final hidden state, or a
    # classifier's class logits there, little-endian float32
    embedding: bytes | None = None

    def cut(self, kept: int) -> TokenOutput:
        """Its first ``kept`` tokens and their log-probabilities (a stop string ended the output at them)."""
        if kept >= len(self.token_ids):
            return self
        def first(values):
            return None if values is None else values[:kept]
        return msgspec.structs.replace(self, token_ids=self.token_ids[:kept], logprobs=first(self.logprobs),
                                       top_logprobs=first(self.top_logprobs), ranks=first(self.ranks),
                                       matched_stop=None)


class SchedulerStats(msgspec.Struct):
    running: int
    waiting: int
    kv_pages_used: int  # held by running requests (their own pages and the cached ones they use)
    kv_pages_total: int
    kv_pages_cached: int = 0  # in the prefix cache and used by no request (evictable)
    prompt_tokens_total: int = 0  # cumulative, for the cache hit rate
    cached_tokens_total: int = 0  # cumulative prompt tokens served from the prefix cache
    evicted_pages_total: int = 0
    preemptions_total: int = 0
    replica: int = 0  # the data-parallel replica (dp_rank) these are of
    draft_tokens_total: int = 0  # speculative decoding: drafts proposed, and those accepted (cumulative)
    accepted_tokens_total: int = 0
    # the LoRA adapters of running and of waiting requests (names, sorted), with LoRA on (vLLM's lora_requests_info)
    running_loras: list[str] = msgspec.field(default_factory=list)
    waiting_loras: list[str] = msgspec.field(default_factory=list)


class LoRAAnswer(msgspec.Struct):
    """A replica's answer to a LoadLoRA or UnloadLoRA: ``error`` None where it was done, else why not."""

    rid: int
    error: str | None = None


class BatchTokenOutput(msgspec.Struct, tag="batch_output"):
    outputs: list[TokenOutput]
    stats: SchedulerStats | None = None
    answers: str | None = None  # the tag of the FlushCache, GetStats, LoadLoRA or UnloadLoRA this answers
    flushed: bool = False  # answering FlushCache: the whole KV pool is free again
    lora: LoRAAnswer | None = None  # answering LoadLoRA or UnloadLoRA
