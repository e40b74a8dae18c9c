"""Beam search as vLLM's (``LLM.beam_search``, and ``use_beam_search`` in the HTTP API), on top of plain generation.

Each step asks every live beam for one token with its 2 x beam_width most likely alternatives (a request of its
own: the prefix cache holds the beam's tokens so far, so only the new token is computed), keeps the beam_width best
extensions by cumulative log-probability, and sets aside those ending in EOS. The answer is the beam_width best of
the finished and the live beams by cumulative log-probability over length ** length_penalty, where the length
counts the prompt's tokens too (vLLM's score, after transformers')."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tpserve.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step asks 2 x beam_width log-probabilities


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # > 0: each beam's sampled token joins its candidates (the others are the most likely)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # a beam ended by EOS keeps the EOS token

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")

    def step_params(self, **extra: Any) -> SamplingParams:
        """What each step asks of a beam: one token and the 2 x beam_width most likely ones."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature,
                              ignore_eos=True, **extra)


@dataclass
class BeamSearchSequence:
    """vLLM's: a beam's tokens (the prompt's first), the log-probabilities of each step that made it (whatever the
    caller records: vLLM's Logprob dicts offline) and, once returned, its text and finish reason."""

    tokens: list[int]
    logprobs: list[Any] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | None = None  # the EOS token id that ended it


@dataclass
class BeamSearchOutput:
    """vLLM's: a prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    return beam.cum_logprob / _length(beam, eos_token_id) ** length_penalty


def _length(beam: BeamSearchSequence, eos_token_id: int | None) -> int:
    """The length the score divides by: at least 1 (a prompt of EOS alone, finished at once, was 0 long)."""
    return max(1, len(beam.tokens) - (1 if beam.tokens[-1] == eos_token_id else 0))


def _log_rank(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """``beam_score``'s order where length ** length_penalty leaves a float's range (an extreme, so non-zero,
    length_penalty): cum_logprob <= 0, so a higher score is a lower log(-cum_logprob) - length_penalty * log(length),
    here over |length_penalty| to stay finite."""
    if beam.cum_logprob >= 0:
        return math.inf
    if beam.cum_logprob == -math.inf or length_penalty == 0:  # (0: the score itself, a -inf among them)
        return beam.cum_logprob
    return (math.copysign(math.log(_length(beam, eos_token_id)), length_penalty)
            - math.log(-beam.cum_logprob) / abs(length_penalty))


class BeamSearch:
    """One prompt's search: ``live`` are the beams to extend next (``advance``) until ``done``; then ``best``."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_id: int | None) -> None:
        self.params, self.eos_token_id = params, eos_token_id
        self.prompt_len = len(prompt_ids)
        self.live = [BeamSearchSequence(list(prompt_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens

    def advance(self, steps: list[tuple[dict[int, float], Any]]) -> None:
        """``steps[i]``: live beam i's candidates (token id -> log-probability) and what to record of its step."""
        params, candidates = self.params, []
        for beam, (options, record) in zip(self.live, steps, strict=True):
            for token, logprob in options.items():
                total = beam.cum_logprob + logprob
                if token == self.eos_token_id and not params.ignore_eos:
                    tokens = beam.tokens + [token] if params.include_stop_str_in_output else beam.tokens
                    self.finished.append(BeamSearchSequence(tokens, beam.logprobs + [record], total,
                                                            finish_reason="stop",
                                                            stop_reason=token))
                else:
                    candidates.append((total, token, beam, record))
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam order, then each beam's candidate order
        self.live = [BeamSearchSequence(beam.tokens + [token], beam.logprobs + [record], total)
                     for total, token, beam, record in candidates[: params.beam_width]]
        self.steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best beams (live ones finish by length), best first; their text is the caller's to set."""
        beams, penalty = self.finished + self.live, self.params.length_penalty
        try:
            scores = [beam_score(beam, self.eos_token_id, penalty) for beam in beams]
            if not all(math.isfinite(score) for score in scores):
                raise OverflowError
        except (OverflowError, ZeroDivisionError):  # past a float's range: ranked in the log domain
            scores = [_log_rank(beam, self.eos_token_id, penalty) for beam in beams]
        ranked = [beam for _, beam in sorted(zip(scores, beams), key=lambda pair: pair[0], reverse=True)]
        best = ranked[: self.params.beam_width]
        for beam in best:
            beam.finish_reason = beam.finish_reason or "length"
        return best

    def token_ids(self, beam: BeamSearchSequence) -> list[int]:
        """A beam's generated tokens as vLLM's API returns them, its usage counting these: a closing EOS only where
        the search kept it (include_stop_str_in_output), unlike a plain request's, which counts its EOS."""
        return beam.tokens[self.prompt_len :]

    def generated(self, beam: BeamSearchSequence) -> list[int]:
        """A beam's generated tokens, less a closing EOS (its text leaves it out, kept or not, as vLLM's)."""
        tokens = self.token_ids(beam)
        return tokens[:-1] if beam.stop_reason is not None and tokens and tokens[-1] == beam.stop_reason else tokens
