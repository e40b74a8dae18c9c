"""What the offline API (``tpserve.llm.LLM``) returns, laid out as vLLM's ``vllm.outputs``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One completion of a prompt; ``index`` is its place among the prompt's ``SamplingParams.n``."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "abort"
    # With SamplingParams(logprobs=n): each token's log-probability, and the n most likely
    # (token id, log-probability) pairs at each position.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # The stop string or stop_token_ids token that ended it; None where it ended otherwise (EOS included), as vLLM's.
    stop_reason: int | str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the tokens' log-probabilities (with SamplingParams(logprobs=...), as vLLM's)."""
        return None if self.logprobs is None else sum(self.logprobs)


@dataclass
class RequestOutput:
    """One prompt's output: its completions in ``outputs`` (``SamplingParams.n`` of them, as vLLM's);
    ``token_ids``, ``text``, ``finish_reason``, ``logprobs`` and ``top_logprobs`` are the first's."""

    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # With SamplingParams(prompt_logprobs=n): each prompt token's log-probability given the ones before
    # it (None for the first), and the n most likely (token id, log-probability) pairs at each position.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank among them (1: the most likely)
    hidden_state: bytes | None = None  # a pooled request's (``SamplingParams.pooling``): ``TokenOutput.embedding``

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
    def logprobs(self) -> list[float] | None:
        return self.outputs[0].logprobs

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        return self.outputs[0].top_logprobs


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (``LLM.embed``), as vLLM's: ``outputs.embedding``."""

    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


@dataclass
class ClassificationOutput:
    probs: list[float]  # the class probabilities (softmax; for one class the sigmoid of its logit)


@dataclass
class ClassificationRequestOutput:
    """One prompt's class probabilities (``LLM.classify``), as vLLM's: ``outputs.probs``."""

    prompt_token_ids: list[int]
    outputs: ClassificationOutput


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (``LLM.score``), as vLLM's: ``outputs.score``; the prompt is the pair's tokens."""

    prompt_token_ids: list[int]
    outputs: ScoringOutput
