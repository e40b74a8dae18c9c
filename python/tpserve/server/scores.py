"""vLLM's score and rerank APIs (``POST /v1/score``, ``/v1/rerank``; also ``/score``, ``/rerank``, ``/v2/rerank``).
As vLLM scores pairs, by the served model's kind:
* an embedding model (a bi-encoder): the cosine similarity of the two texts' embeddings (last-token pooling,
  ``server/embeddings.py``);
* a sequence classifier with one class (a cross-encoder): the pair tokenized as one prompt (the tokenizer's pair
  encoding), its relevance logit through a sigmoid (``use_activation`` False: the logit)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Union

from fastapi import Request
from fastapi.responses import Response
from pydantic import StrictStr

from tpserve.message.frontend import TokenizeRequest
from tpserve.pooling import class_scores, embedding_vector, pair_texts
from tpserve.sampling_params import SamplingParams
from tpserve.server.classify import ActivationField
from tpserve.server.embeddings import Labelled, check_task, field_of, hidden_states, pooled_params, pooled_requests
from tpserve.server.errors import APIError
from tpserve.server.formats import Choice, ResponseFormat
from tpserve.server.request_id import request_id
from tpserve.server.serving import Serving

Texts = Union[StrictStr, list[StrictStr]]
# A cross-encoder tokenizes a query once per document: the query's characters times its documents may come to this
# many prompts' worth (a short body must not make the tokenizers read a long query hundreds of times)
REPEATED_TEXT_PROMPTS = 4
Pair = tuple[tuple[str, str], tuple[str, str]]  # (label, text) of the first text and of the second
# The pairs' scores and prompt tokens from the answers (choices) to the requests ``pair_requests`` made, in pair
# order. A pair's tokens are its prompt's, or a bi-encoder's two texts' together (a query once per pair, as vLLM
# counts a bi-encoder's pair: its usage is the pairs', not the texts embedded)
Scorer = Callable[[Iterable[Choice]], list[tuple[float, int]]]


class _PairsBody(ActivationField):
    """(A cross-encoder's activation off: a pair is scored with its raw logit.)"""

    model: str | None = None
    truncate_prompt_tokens: int | None = None  # each prompt's last k tokens only (-1: as many as fit)
    priority: int = 0  # vLLM's: under --schedule-policy priority, lower values are served first

    def sampling_params(self, task: str) -> SamplingParams:
        return pooled_params(task, self.truncate_prompt_tokens, priority=self.priority)


# vLLM's names for a score request's two sides, in the order its request union tries them (the newest first)
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class ScoreRequest(_PairsBody):
    """Pairs (first[i], second[i]); a single first text pairs with every second. The two sides by any of vLLM's
    names for them (SCORE_SIDES): text_1 and text_2, or newer vLLM's queries and documents (or items), data_1 and
    data_2."""

    text_1: Texts | None = None
    text_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None

    def sides(self) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
        """The two sides' names and texts: the first of SCORE_SIDES given whole, else a 400 naming what is missing."""
        for names in SCORE_SIDES:
            given = [getattr(self, name) for name in names]
            if all(v is not None for v in given):
                first, second = ([v] if isinstance(v, str) else list(v) for v in given)
                return (names[0], first), (names[1], second)
        for names in sorted(SCORE_SIDES, key=lambda n: n[0] == "queries"):  # one side given: the other is missing
            if any(getattr(self, name) is not None for name in names):
                missing = next(name for name in names if getattr(self, name) is None)
                raise APIError.invalid(f"{missing} is required with {names[1 - names.index(missing)]}", missing)
        raise APIError.invalid("give the texts to score: text_1 and text_2 (or queries and documents)", "text_1")

    def pairs(self) -> list[Pair]:
        """(first[i], second[i]), or (first[0], second[i]) for one first text; checked."""
        (name_1, first), (name_2, second) = self.sides()
        for name, texts in ((name_1, first), (name_2, second)):
            if not texts or any(not t for t in texts):
                raise APIError.invalid(f"{name} must hold at least one text and no empty one", name)
        try:
            index_pairs = pair_texts(first, second, (name_1, name_2))
        except ValueError as e:
            raise APIError.invalid(str(e), name_1) from None
        return [((f"{name_1}[{i}]", first[i]), (f"{name_2}[{j}]", second[j])) for i, j in index_pairs]


class RerankRequest(_PairsBody):
    query: StrictStr
    documents: list[StrictStr]
    top_n: int | None = None  # the best this many (None or 0: all)
    return_documents: bool = True  # each result's document text (Jina's and vLLM's default; Cohere's is false)

    def pairs(self) -> list[Pair]:
        """(query, documents[i]) for each document, checked."""
        if not self.query:
            raise APIError.invalid("query must not be empty", "query")
        if not self.documents or any(not d for d in self.documents):
            raise APIError.invalid("documents must hold at least one text and no empty one", "documents")
        if self.top_n is not None and self.top_n < 0:
            raise APIError.invalid("top_n must be >= 0 (0: all)", "top_n")
        return [(("query", self.query), (f"documents[{i}]", d)) for i, d in enumerate(self.documents)]


def pair_requests(serving: Serving, body: _PairsBody, pairs: list[Pair]) -> tuple[list[TokenizeRequest], Scorer]:
    """The backend requests that score ``pairs`` on the served model, and how to score them from the answers. A
    bi-encoder embeds each text once (a query shared by every pair too); a cross-encoder tokenizes each pair as one
    prompt (the tokenizer's pair encoding, or the two texts joined for an LLM as reranker, as vLLM), so a query is
    tokenized once per document (REPEATED_TEXT_PROMPTS)."""
    check_task(serving, "score")
    texts = list(dict.fromkeys([a for a, _ in pairs] + [b for _, b in pairs]))  # each (label, text) once
    if not serving.head.classifies:
        return pooled_requests(serving, texts, body.sampling_params("embed")), cosine_scorer(texts, pairs)
    for label, text in texts:  # a text too long is named by its own field
        serving.limits.check_text(len(text), field_of(label))
    first_label, first = pairs[0][0]
    repeats = sum(1 for (label, _), _ in pairs if label == first_label)
    if len(first) * repeats > REPEATED_TEXT_PROMPTS * serving.limits.max_prompt_chars:
        raise APIError.invalid(
            f"{first_label} ({len(first)} characters) is tokenized again with each of the {repeats} texts it is "
            f"paired with: more than {REPEATED_TEXT_PROMPTS} prompts' worth of characters ({REPEATED_TEXT_PROMPTS} x "
            f"{serving.limits.max_prompt_chars}); send a shorter {field_of(first_label)} or fewer texts at a time",
            field_of(first_label))
    joined = serving.head.joins_pairs
    inputs: list[Labelled] = [(b_label, a + b if joined else (a, b)) for (_, a), (b_label, b) in pairs]
    reqs = pooled_requests(serving, inputs, body.sampling_params("classify"))
    return reqs, cross_scorer([label for label, _ in inputs], body.class_activation(serving.head.score_activation))


def cross_scorer(labels: list[str], activation: str) -> Scorer:
    """A cross-encoder's pair scores: choice i's relevance logit through ``activation``, and its prompt's tokens."""

    def scores(choices: Iterable[Choice]) -> list[tuple[float, int]]:
        ordered = sorted(choices, key=lambda c: c.index)
        raws = hidden_states(ordered, labels, "scored")
        return [(float(class_scores(raw, activation)[0]), c.prompt_tokens) for raw, c in zip(raws, ordered)]

    return scores


def cosine_scorer(texts: list[tuple[str, str]], pairs: list[Pair]) -> Scorer:
    """A bi-encoder's pair scores: the cosines of the pair's embeddings (choice i embeds ``texts[i]``; each vector
    is normalized once, a query's shared by every pair), and the two texts' tokens together."""
    slot = {text: i for i, text in enumerate(texts)}

    def cosines(choices: Iterable[Choice]) -> list[tuple[float, int]]:
        ordered = sorted(choices, key=lambda c: c.index)
        vectors = [embedding_vector(raw) for raw in hidden_states(ordered, [label for label, _ in texts])]
        return [(float(vectors[slot[a]] @ vectors[slot[b]]), ordered[slot[a]].prompt_tokens +
                 ordered[slot[b]].prompt_tokens) for a, b in pairs]

    return cosines


class ScoreFormat(ResponseFormat):
    """``/v1/score``'s list: one score per pair."""

    id_prefix = "score"

    def __init__(self, model: str, scorer: Scorer, request_id: str | None = None) -> None:
        super().__init__(model, request_id=request_id)
        self.scorer = scorer

    def response(self, choices: Iterable[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        scored = self.scorer(choices)
        data = [{"index": i, "object": "score", "score": score} for i, (score, _) in enumerate(scored)]
        tokens = sum(n for _, n in scored)
        return {"id": self.id, "object": "list", "created": self.created, "model": self.model, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}


class RerankFormat(ResponseFormat):
    """The rerank API's results (Jina's and Cohere's layout, as vLLM's): documents by relevance, best first."""

    id_prefix = "rerank"

    def __init__(self, model: str, body: RerankRequest, scorer: Scorer, request_id: str | None = None) -> None:
        super().__init__(model, request_id=request_id)
        self.body, self.scorer = body, scorer

    def response(self, choices: Iterable[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        scored = self.scorer(choices)
        results = [{"index": i, "relevance_score": score} | ({"document": {"text": text}} if self.body.return_documents
                                                             else {})
                   for i, (text, (score, _)) in enumerate(zip(self.body.documents, scored))]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)
        if self.body.top_n:
            results = results[: self.body.top_n]
        tokens = sum(n for _, n in scored)
        return {"id": self.id, "model": self.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results}


async def create_scores(serving: Serving, body: ScoreRequest, request: Request) -> Response:
    serving.check_model(body.model)
    reqs, scorer = pair_requests(serving, body, body.pairs())
    return await serving.run(reqs, ScoreFormat(serving.model_name, scorer, request_id(request)), False, request)


async def create_rerank(serving: Serving, body: RerankRequest, request: Request) -> Response:
    serving.check_model(body.model)
    reqs, scorer = pair_requests(serving, body, body.pairs())
    return await serving.run(reqs, RerankFormat(serving.model_name, body, scorer, request_id(request)), False, request)
