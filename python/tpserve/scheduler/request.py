"""A request as the scheduler tracks it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpserve.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new_tokens: int  # resolved from max_tokens and the context limit
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading tokens whose K/V are in the cache
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def next_input(self) -> list[int]:
        """Tokens to compute this step: the prompt (prefill) or the last sampled token."""
        ids = self.prompt_ids + self.output_ids
        return ids[self.num_cached :]
