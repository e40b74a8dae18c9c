"""A request as the scheduler tracks it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tpserve.kvcache.radix import Node
from tpserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from tpserve.engine.lora_slots import LoadedAdapter
    from tpserve.scheduler.ngram import TokenHistory
    from tpserve.structured.grammar import RequestGrammar


@dataclass(eq=False)
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new_tokens: int  # resolved from max_tokens and the context limit
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # page table: shared prefix pages, then its own
    num_shared_pages: int = 0  # leading pages that belong to the prefix cache
    prefix_node: Node | None = None  # the locked prefix-cache node behind the shared pages
    num_cached: int = 0  # leading tokens whose K/V are computed (or enqueued on the device)
    pending: int = 0  # 1 while a launched step's sample for it is not yet known on the host
    future_row: int = -1  # its row in the last launched step, where that pending sample is
    admit_order: int = -1  # when it was (last) admitted; the newest is preempted first
    arrival: int = -1  # when it reached the scheduler (the priority policy admits by priority, then arrival)
    cached_tokens: int = -1  # prefix-cache hit at first admission, reported in usage
    finish_reason: str | None = None
    slot: int = -1  # its row of the engine's penalty state (-1: none), kept until it finishes
    adapter: LoadedAdapter | None = None  # its LoRA adapter (kept if the adapter is unloaded meanwhile)
    lora_slot: int = 0  # its adapter's slot in the layers (0: none), taken at each admission, kept while running
    prefix_key: str | None = None  # whose cached prefixes it shares (params.prefix_key, apart for each adapter load)
    grammar: RequestGrammar | None = None  # structured output: its matcher
    allowed_mask: torch.Tensor | None = None  # params.allowed_token_ids on the device (logit_edits.allowed_mask)
    # params.prompt_logprobs: entry p is (log-probability of prompt token p + 1, top (id, log-probability) pairs,
    # its rank in the vocabulary)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]], int] | None] | None = None
    drafts: list[int] = field(default_factory=list)  # speculative decoding: this step's drafts after its last token
    history: TokenHistory | None = None  # its tokens as the n-gram drafts search them (made at its first draft)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are still to compute (they go out with its first token)."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_to_compute(self) -> int:
        """Tokens to compute before the next sample: 1 when decoding, more when (re)prefilling."""
        return self.num_tokens + self.pending - self.num_cached

    @property
    def samples_left(self) -> int:
        return self.max_new_tokens - len(self.output_ids) - self.pending

    def input_ids(self, n: int) -> list[int]:
        """The next ``n`` tokens to compute; a pending sample is the placeholder -(row + 1)."""
        start, end, prompt_len = self.num_cached, self.num_cached + n, len(self.prompt_ids)
        if end <= prompt_len:  # without building prompt + output, which grows every step
            ids = self.prompt_ids[start:end]
        elif start >= prompt_len:
            ids = self.output_ids[start - prompt_len : end - prompt_len]
        else:
            ids = self.prompt_ids[start:] + self.output_ids[: end - prompt_len]
        if self.pending and len(ids) < n:
            ids.append(-(self.future_row + 1))
        return ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
