"""A request as the scheduler tracks it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpserve.kvcache.radix import Node
from tpserve.sampling_params import SamplingParams


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
    num_cached: int = 0  # leading tokens whose K/V are in the cache
    admit_order: int = -1  # when it was (last) admitted; the newest is preempted first
    cached_tokens: int = -1  # prefix-cache hit at first admission, reported in usage
    finish_reason: str | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens to compute before the next sample: 1 when decoding, more when (re)prefilling."""
        return self.num_tokens - self.num_cached

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
