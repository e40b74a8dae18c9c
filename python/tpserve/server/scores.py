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
from tpserve.pooling import embedding_vector
from tpserve.sampling_params import SamplingParams
from tpserve.server.classify import class_scores
from tpserve.server.embeddings import Labelled, check_task, hidden_states, pooled_params, pooled_requests
from tpserve.server.errors import APIError
from tpserve.server.formats import Choice, ResponseFormat
from tpserve.server.protocol import UNSERVED_VLLM_FIELDS, _Body
from tpserve.server.request_id import request_id
from tpserve.server.serving import Serving

Texts = Union[StrictStr, list[StrictStr]]
# The pairs' scores from the answers (choices) to the requests ``pair_requests`` made, in pair order
Scorer = Callable[[Iterable[Choice]], list[float]]


class _PairsBody(_Body):
    model: str | None = None
    truncate_prompt_tokens: int | None = None  # each prompt's last k tokens only (-1: as many as fit)
    use_activation: bool = True  # a cross-encoder's: False scores a pair with its raw logit

    def sampling_params(self, task: str) -> SamplingParams:
        self.refuse_unserved(UNSERVED_VLLM_FIELDS)
        return pooled_params(task, self.truncate_prompt_tokens)


class ScoreRequest(_PairsBody):
    """Pairs (text_1[i], text_2[i]); a single text_1 pairs with every text_2."""

    text_1: Texts
    text_2: Texts

    def texts(self) -> tuple[list[str], list[str]]:
        """text_1 (one text, or one per text_2) and text_2, checked."""
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        for name, texts in (("text_1", first), ("text_2", second)):
            if not texts or any(not t for t in texts):
                raise APIError.invalid(f"{name} must hold at least one text and no empty one", name)
        if len(first) != 1 and len(first) != len(second):
            raise APIError.invalid(f"text_1 must hold one text or as many as text_2 ({len(second)}), got {len(first)}",
                                   "text_1")
        return first, second


class RerankRequest(_PairsBody):
    query: StrictStr
    documents: list[StrictStr]
    top_n: int | None = None  # the best this many (None or 0: all)

    def texts(self) -> list[str]:
        """The query, then the documents, checked."""
        if not self.query:
            raise APIError.invalid("query must not be empty", "query")
        if not self.documents or any(not d for d in self.documents):
            raise APIError.invalid("documents must hold at least one text and no empty one", "documents")
        if self.top_n is not None and self.top_n < 0:
            raise APIError.invalid("top_n must be >= 0 (0: all)", "top_n")
        return [self.query, *self.documents]


def pair_requests(
    serving: Serving, body: _PairsBody, pairs: list[tuple[tuple[str, str], tuple[str, str]]]
) -> tuple[list[TokenizeRequest], Scorer]:
    """The backend requests that score ``pairs`` ((label, text) and (label, text)) on the served model, and how to
    score them from the answers. A bi-encoder embeds each text once (a query shared by every pair too)."""
    if serving.head.classifies:
        if len(serving.head.labels) != 1:
            raise APIError.invalid(
                f"this model classifies into {len(serving.head.labels)} classes; scoring pairs needs a cross-encoder "
                "with one (its relevance logit): use /classify", "model")
        inputs: list[Labelled] = [(b_label, (a, b)) for (_, a), (b_label, b) in pairs]
        reqs = pooled_requests(serving, inputs, body.sampling_params("classify"))
        return reqs, cross_scorer([label for label, _ in inputs], body.use_activation)
    check_task(serving, "embed")
    texts = list(dict.fromkeys([a for a, _ in pairs] + [b for _, b in pairs]))  # each (label, text) once
    return pooled_requests(serving, texts, body.sampling_params("embed")), cosine_scorer(texts, pairs)


def cross_scorer(labels: list[str], activation: bool) -> Scorer:
    """A cross-encoder's pair scores: choice i's relevance logit, through a sigmoid where ``activation``."""
    return lambda choices: [float(class_scores(raw, activation)[0]) for raw in hidden_states(choices, labels, "scored")]


def cosine_scorer(texts: list[tuple[str, str]], pairs: list[tuple[tuple[str, str], tuple[str, str]]]) -> Scorer:
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
        results = [{"index": i, "document": {"text": text}, "relevance_score": score}
                   for i, (text, score) in enumerate(zip(self.body.documents, self.scorer(choices)))]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)
        if self.body.top_n:
            results = results[: self.body.top_n]
        return {"id": self.id, "model": self.model, "usage": {"total_tokens": usage["prompt_tokens"]},
                "results": results}


async def create_scores(serving: Serving, body: ScoreRequest, request: Request) -> Response:
    serving.check_model(body.model)
    first, second = body.texts()
    firsts = [(f"text_1[{i}]", t) for i, t in enumerate(first)] * (len(second) if len(first) == 1 else 1)
    pairs = list(zip(firsts, ((f"text_2[{i}]", t) for i, t in enumerate(second))))
    reqs, scorer = pair_requests(serving, body, pairs)
    return await serving.run(reqs, ScoreFormat(serving.model_name, scorer, request_id(request)), False, request)


async def create_rerank(serving: Serving, body: RerankRequest, request: Request) -> Response:
    serving.check_model(body.model)
    query, *documents = body.texts()
    pairs = [(("query", query), (f"documents[{i}]", d)) for i, d in enumerate(documents)]
    reqs, scorer = pair_requests(serving, body, pairs)
    return await serving.run(reqs, RerankFormat(serving.model_name, body, scorer, request_id(request)), False, request)
