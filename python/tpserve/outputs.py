"""What the offline API (``tpserve.llm.LLM``) returns, laid out as vLLM's ``vllm.outputs``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """vLLM's ``vllm.logprobs.Logprob``: a token's log-probability at one position, its rank in the vocabulary there
    (1: the most likely) and its text (``tokenizer.decode([token_id])``; None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's SampleLogprobs / PromptLogprobs: at each position, token id -> Logprob (the chosen token first, then the
# asked most likely ones by rank)
LogprobsOnePosition = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a prompt; ``index`` is its place among the prompt's ``SamplingParams.n``."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "abort"
    # With SamplingParams(logprobs=n), as vLLM's: at each generated token, its Logprob and the n most likely tokens'.
    logprobs: list[LogprobsOnePosition] | None = None
    # The same, flat: the n most likely (token id, log-probability) pairs at each position ...
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # The stop string or stop_token_ids token that ended it; None where it ended otherwise (EOS included), as vLLM's.
    stop_reason: int | str | None = None
    # ... and each generated token's log-probability.
    token_logprobs: list[float] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the tokens' log-probabilities (with SamplingParams(logprobs=...), as vLLM's)."""
        return None if self.token_logprobs is None else sum(self.token_logprobs)

    def finished(self) -> bool:
        """As vLLM's ``CompletionOutput.finished()``."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's output: its completions in ``outputs`` (``SamplingParams.n`` of them, as vLLM's);
    ``token_ids``, ``text``, ``finish_reason``, ``logprobs``, ``top_logprobs`` and ``token_logprobs`` are the
    first's. ``request_id``, ``prompt`` (the text of a text prompt; None for token ids and chat, as vLLM's),
    ``finished`` and ``num_cached_tokens`` (prompt tokens served from the prefix cache) as vLLM's."""

    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # With SamplingParams(prompt_logprobs=n), as vLLM's: None for the first prompt token, then at each prompt token
    # its Logprob given the ones before it and the n most likely tokens'.
    prompt_logprobs: list[LogprobsOnePosition | None] | None = None
    # The same, flat: the n most likely (token id, log-probability) pairs at each position, each prompt token's
    # rank among them (1: the most likely) and its log-probability (None for the first).
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    hidden_state: bytes | None = None  # a pooled request's (``SamplingParams.pooling``): ``TokenOutput.embedding``
    request_id: str = ""
    prompt: str | None = None
    finished: bool = True
    num_cached_tokens: int = 0
    prompt_token_logprobs: list[float | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[LogprobsOnePosition] | None:
        return self.outputs[0].logprobs

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        return self.outputs[0].top_logprobs

    @property
    def token_logprobs(self) -> list[float] | None:
        return self.outputs[0].token_logprobs


def position_logprobs(token: int, logprob: float, rank: int, top: list[tuple[int, float]],
                      decode: Callable[[int], str | None]) -> LogprobsOnePosition:
    """One position's vLLM logprobs: the chosen token first, then the most likely ones by rank (the chosen one among
    them keeps its place and takes its rank there, as vLLM's dict)."""
    out = {token: Logprob(logprob, rank, decode(token))}
    for i, (t, value) in enumerate(top, 1):
        out[t] = Logprob(value, i, decode(t))
    return out


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (``LLM.embed``), as vLLM's: ``outputs.embedding``."""

    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    request_id: str = ""
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]  # the class probabilities (softmax; for one class the sigmoid of its logit)


@dataclass
class ClassificationRequestOutput:
    """One prompt's class probabilities (``LLM.classify``), as vLLM's: ``outputs.probs``."""

    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    request_id: str = ""
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (``LLM.score``), as vLLM's: ``outputs.score``; the prompt is the pair's tokens."""

    prompt_token_ids: list[int]
    outputs: ScoringOutput
    request_id: str = ""
    finished: bool = True
