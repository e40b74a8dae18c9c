"""Speculative decoding with n-gram drafts (vLLM's ``--speculative-config '{"method": "ngram", ...}'``, prompt lookup):
a decoding request whose last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) appeared before
in its prompt or output drafts the tokens that followed them there, and one step computes its last token and the
drafts together. Each position's token is sampled as a plain step would (its own step's seed), and the drafts are
accepted while they equal those samples: the output is the one decoding gives, token for token (for random sampling
too: sampling t ~ p and keeping a draft d where t == d accepts d with probability p(d), the rejection rule for a
draft of probability one, and a rejected position's t is then p's sample outside d), only in fewer steps."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tpserve.kvcache.pool import PageAllocator
    from tpserve.scheduler.request import Request

METHODS = ("ngram", "[ngram]")  # vLLM's names for it


@dataclass(frozen=True)
class NgramConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = None  # no drafts while more requests than this run

    @classmethod
    def from_json(cls, text: str | None) -> NgramConfig | None:
        """vLLM's speculative_config (JSON text; None: off); a ValueError names what tpserve cannot serve. Only
        the n-gram method: its drafts need no second model."""
        if text is None:
            return None
        try:
            config = json.loads(text)
        except ValueError as e:
            raise ValueError(f"speculative_config must be a JSON object, got {text!r} ({e})") from None
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {text!r}")
        method, model = config.get("method"), config.get("model")
        if method is None and model in METHODS:
            method = "ngram"  # vLLM's older spelling: the model names the method
        if method not in METHODS:
            named = f"method {method!r}" if method is not None else None if model is None else f"model {model!r}"
            served = "" if named is None else f" ({named}: drafts from a second model are not served)"
            raise ValueError(f"speculative_config: tpserve serves method \"ngram\" only{served}")
        if model is not None and model not in METHODS:
            raise ValueError(f"speculative_config: model {model!r}: drafts from a second model are not served")
        unknown = sorted(set(config) - {"method", "model", "num_speculative_tokens", "prompt_lookup_min",
                                        "prompt_lookup_max", "disable_by_batch_size"})
        if unknown:
            raise ValueError(f"speculative_config: {', '.join(unknown)} is not served with the ngram method")
        low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = 5  # vLLM's defaults
        low, high = (high if low is None else low), (low if high is None else high)
        values = {"num_speculative_tokens": config.get("num_speculative_tokens"), "prompt_lookup_min": low,
                  "prompt_lookup_max": high}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min {low} is above prompt_lookup_max {high}")
        limit = config.get("disable_by_batch_size")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 2):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 2, got {limit!r}")
        return cls(values["num_speculative_tokens"], low, high, limit)

    def propose(self, tokens: np.ndarray, most: int, skip: int = 0) -> list[int]:
        """Up to ``most`` drafts after ``tokens`` (a request's prompt and output so far): the tokens that followed
        the latest earlier occurrence of its longest suffix of ``prompt_lookup_min``..``prompt_lookup_max`` tokens
        that has one, the first ``skip`` of them left out (guesses of tokens sampled but not yet known). An
        occurrence followed by too few tokens (in a run of one repeated token, the latest is the one just before)
        gives way to the latest followed by enough, else the earliest."""
        most = min(most, self.num_speculative_tokens)
        length = len(tokens)
        top = min(self.prompt_lookup_max, length - 1)
        if top < self.prompt_lookup_min:
            return []
        # Where an earlier occurrence could end (its last token equals the last token), and how many tokens up to
        # ``top`` each matches backwards: one compare over the history, then small arrays. The same drafts as a
        # sliding window per suffix length, which took 21 / 64 / 462 us a request a step at 150 / 2,000 / 20,000
        # tokens against 17 / 18 / 28 (benchmarks/ngram_drafts.py, docs/benchmarks.md).
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        matched = np.ones(len(ends), dtype=np.int64)
        for k in range(1, top):
            behind = ends - k
            agrees = (matched == k) & (behind >= 0)
            agrees[agrees] = tokens[behind[agrees]] == tokens[length - 1 - k]
            if not agrees.any():
                break
            matched[agrees] = k + 1
        for n in range(top, self.prompt_lookup_min - 1, -1):
            starts = ends[matched >= n] + 1 + skip  # where each occurrence's following tokens start
            if not len(starts):
                continue
            enough = starts[starts + most <= length]
            start = int(enough[-1] if len(enough) else starts[0])
            if start < length:
                return tokens[start: start + most].tolist()
        return []


class TokenHistory:
    """A request's prompt and output tokens as one array, grown as tokens come (drafts search it every step)."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_len = len(prompt_ids)
        self.array = np.empty(max(64, 2 * self.prompt_len), dtype=np.int64)
        self.array[: self.prompt_len] = prompt_ids
        self.length = self.prompt_len

    def tokens(self, output_ids: list[int]) -> np.ndarray:
        new = output_ids[self.length - self.prompt_len:]
        end = self.length + len(new)
        if end > len(self.array):
            grown = np.empty(2 * end, dtype=np.int64)
            grown[: self.length] = self.array[: self.length]
            self.array = grown
        self.array[self.length: end] = new
        self.length = end
        return self.array[:end]


class Drafting:
    """The scheduler's side of it (mixed into ``Scheduler``): each decoding request's drafts, and the tokens a
    drafted row keeps."""

    speculative: NgramConfig | None
    running: dict[int, Request]
    allocator: PageAllocator
    max_model_len: int
    page_size: int
    draft_tokens_total: int
    accepted_tokens_total: int

    def _drafts(self, req: Request) -> list[int]:
        """A decoding request's n-gram drafts for this step (speculative decoding), as many as its token budget,
        the context and its own pages plus the free ones allow (drafts never take a cached prefix's pages).
        Under overlap its last token may still be on the device (``pending``): the search then ends a token
        earlier and its first draft, that token's guess, is dropped (a wrong guess leaves drafts that its
        sample rejects). A step with drafts is drained before the next is planned (``_Launched.needs_drain``):
        the next chunk starts where its accepted tokens end."""
        spec = self.speculative
        if (spec is None or req.pending > 1 or req.params.edits_logits or req.params.pooling is not None
                or (spec.disable_by_batch_size is not None and len(self.running) > spec.disable_by_batch_size)):
            return []
        room = min(req.samples_left, self.max_model_len - req.num_tokens - req.pending) - 1
        room = min(room, (len(req.pages) + self.allocator.num_free) * self.page_size - req.num_cached - 1)
        if room <= 0:
            return []
        if req.history is None:
            req.history = TokenHistory(req.prompt_ids)
        return spec.propose(req.history.tokens(req.output_ids), room, skip=req.pending)

    def _accepted(self, req: Request, drafts: list[int], first: int, tokens: list[int],
                  row: int) -> tuple[list[int], list[int]]:
        """A drafted row's new tokens and their sample rows: each position's sample (``first`` on among
        ``tokens``; the last position's at ``row``) while the draft after it equals it, then the first that does
        not. The K/V computed past them is left behind (overwritten when those positions come again)."""
        rows = [*range(first, first + len(drafts)), row]
        samples = [tokens[r] for r in rows]
        accepted = next((i for i, (draft, sample) in enumerate(zip(drafts, samples)) if draft != sample), len(drafts))
        self.draft_tokens_total += len(drafts)
        self.accepted_tokens_total += accepted
        req.num_cached -= len(drafts) - accepted
        return samples[: accepted + 1], rows[: accepted + 1]
