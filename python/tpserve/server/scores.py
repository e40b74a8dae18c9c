"""vLLM's score and rerank APIs (``POST /v1/score``, ``/v1/rerank``; also ``/score``, ``/rerank``, ``/v2/rerank``).
As vLLM scores pairs, by the served model's kind:
* an embedding model (a bi-encoder): the cosine similarity of the two texts' embeddings (last-token pooling,
  ``server/embeddings.py``);
* a sequence classifier with one class (a cross-encoder): the pair tokenized as one prompt (the tokenizer's pair
  encoding), its relevance logit through a sigmoid (``use_activation`` False: the logit)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Union

import numpy as np
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
from tpserve.server.protocol import UNSERVED_VLLM_FIELDS
from tpserve.server.request_id import request_id
from tpserve.server.serving import Serving

Texts = Union[StrictStr, list[StrictStr]]
# A cross-encoder tokenizes a query once per document: the query's characters times its documents may come to this
# many prompts' worth (a short body must not make the tokenizers read a long query hundreds of times)
REPEATED_TEXT_PROMPTS = 4
Pair = tuple[tuple[str, str], tuple[str, str]]  # (label, text) of the first text and of the second
# The pairs' scores from the answers (choices) to the requests ``pair_requests`` made, in pair order
Scorer = Callable[[Iterable[Choice]], list[float]]


class _PairsBody(ActivationField):
    """(A cross-encoder's activation off: a pair is scored with its raw logit.)"""

    model: str | None = None
    truncate_prompt_tokens: int | None = None  # each prompt's last k tokens only (-1: as many as fit)

    def sampling_params(self, task: str) -> SamplingParams:
        self.refuse_unserved(UNSERVED_VLLM_FIELDS)
        return pooled_params(task, self.truncate_prompt_tokens)


class ScoreRequest(_PairsBody):
    """Pairs (text_1[i], text_2[i]); a single text_1 pairs with every text_2."""

    text_1: Texts
    text_2: Texts

    def pairs(self) -> list[Pair]:
        """(text_1[i], text_2[i]), or (text_1[0], text_2[i]) for one text_1; checked."""
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        for name, texts in (("text_1", first), ("text_2", second)):
            if not texts or any(not t for t in texts):
                raise APIError.invalid(f"{name} must hold at least one text and no empty one", name)
        try:
            index_pairs = pair_texts(first, second, ("text_1", "text_2"))
        except ValueError as e:
            raise APIError.invalid(str(e), "text_1") from None
        return [((f"text_1[{i}]", first[i]), (f"text_2[{j}]", second[j])) for i, j in index_pairs]


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
    """A cross-encoder's pair scores: choice i's relevance logit through ``activation``."""
    return lambda choices: [float(class_scores(raw, activation)[0]) for raw in hidden_states(choices, labels, "scored")]


def cosine_scorer(texts: list[tuple[str, str]], pairs: list[Pair]) -> Scorer:
    """A bi-encoder's pair scores: the cosines of the pair's embeddings (choice i embeds ``texts[i]``; each vector
    is normalized once, a query's shared by every pair)."""
    slot = {text: i for i, text in enumerate(texts)}

    def cosines(choices: Iterable[Choice]) -> list[float]:
        vectors = [embedding_vector(raw) for raw in hidden_states(choices, [label for label, _ in texts])]
        return [float(vectors[slot[a]] @ vectors[slot[b]]) for a, b in pairs]

    return cosines


class ScoreFormat(ResponseFormat):
    """``/v1/score``'s list: one score per pair."""

    id_prefix = "score"

    def __init__(self, model: str, scorer: Scorer, request_id: str | None = None) -> None:
        super().__init__(model, request_id=request_id)
        self.scorer = scorer

    def response(self, choices: Iterable[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(self.scorer(choices))]
        tokens = usage["prompt_tokens"]
        return {"id": self.id, "object": "list", "created": self.created, "model": self.model, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class RerankFormat(ResponseFormat):
    """The rerank API's results (Jina's and Cohere's layout, as vLLM's): documents by relevance, best first."""

    id_prefix = "rerank"

    def __init__(self, model: str, body: RerankRequest, scorer: Scorer, request_id: str | None = None) -> None:
        super().__init__(model, request_id=request_id)
        self.body, self.scorer = body, scorer

    def response(self, choices: Iterable[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        results = [{"index": i, "relevance_score": score} | ({"document": {"text": text}} if self.body.return_documents
                                                             else {})
                   for i, (text, score) in enumerate(zip(self.body.documents, self.scorer(choices)))]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)
        if self.body.top_n:
            results = results[: self.body.top_n]
        return {"id": self.id, "model": self.model, "usage": {"total_tokens": usage["prompt_tokens"]},
                "results": results}


async def create_scores(serving: Serving, body: ScoreRequest, request: Request) -> Response:
    serving.check_model(body.model)
    reqs, scorer = pair_requests(serving, body, body.pairs())
    return await serving.run(reqs, ScoreFormat(serving.model_name, scorer, request_id(request)), False, request)


async def create_rerank(serving: Serving, body: RerankRequest, request: Request) -> Response:
    serving.check_model(body.model)
    reqs, scorer = pair_requests(serving, body, body.pairs())
    return await serving.run(reqs, RerankFormat(serving.model_name, body, scorer, request_id(request)), False, request)
