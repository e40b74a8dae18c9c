"""vLLM's score and rerank APIs for an embedding model (``POST /v1/score``, ``/v1/rerank``; also ``/score``,
``/rerank``, ``/v2/rerank``): a pair's score is the cosine similarity of the two texts' embeddings (last-token
pooling, ``server/embeddings.py``), as vLLM scores pairs with a bi-encoder. A cross-encoder (a reranker whose score
is a classification head's, e.g. Qwen3-Reranker's yes/no logits) is not served."""

from __future__ import annotations

from typing import Any, Iterable, Union

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import StrictStr

from tpserve.pooling import embedding_vector
from tpserve.sampling_params import SamplingParams
from tpserve.server.embeddings import embedding_requests, hidden_states
from tpserve.server.errors import APIError
from tpserve.server.formats import Choice, ResponseFormat
from tpserve.server.protocol import UNSERVED_VLLM_FIELDS, _Body, _param_of
from tpserve.server.request_id import request_id
from tpserve.server.serving import Serving

Texts = Union[StrictStr, list[StrictStr]]


class _PairsBody(_Body):
    model: str | None = None
    truncate_prompt_tokens: int | None = None  # each text's last k tokens only (-1: as many as fit)

    def sampling_params(self) -> SamplingParams:
        self.refuse_unserved(UNSERVED_VLLM_FIELDS)
        try:
            return SamplingParams(embed=True, max_tokens=1, truncate_prompt_tokens=self.truncate_prompt_tokens)
        except ValueError as e:
            raise APIError.invalid(str(e), _param_of(str(e))) from e


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


def unit_vectors(states: list[bytes]) -> list[np.ndarray]:
    """Each text's embedding, normalized once (a query's is dotted with every document's)."""
    return [embedding_vector(state) for state in states]


class ScoreFormat(ResponseFormat):
    """``/v1/score``'s list: choice i is text i of text_1 + text_2 as submitted (``first`` texts from text_1)."""

    id_prefix = "score"

    def __init__(self, model: str, labels: list[str], first: int, request_id: str | None = None) -> None:
        super().__init__(model, request_id=request_id)
        self.labels, self.first = labels, first

    def response(self, choices: Iterable[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        vectors = unit_vectors(hidden_states(choices, self.labels))
        left, right = vectors[: self.first], vectors[self.first :]
        left = left * len(right) if len(left) == 1 else left
        data = [{"index": i, "object": "score", "score": float(a @ b)} for i, (a, b) in enumerate(zip(left, right))]
        tokens = usage["prompt_tokens"]
        return {"id": self.id, "object": "list", "created": self.created, "model": self.model, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class RerankFormat(ResponseFormat):
    """The rerank API's results (Jina's and Cohere's layout, as vLLM's): documents by relevance, best first."""

    id_prefix = "rerank"

    def __init__(self, model: str, body: RerankRequest, request_id: str | None = None) -> None:
        super().__init__(model, request_id=request_id)
        self.body = body

    def response(self, choices: Iterable[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        labels = ["query", *(f"documents[{i}]" for i in range(len(self.body.documents)))]
        query, *documents = unit_vectors(hidden_states(choices, labels))
        results = [{"index": i, "document": {"text": text}, "relevance_score": float(query @ vector)}
                   for i, (text, vector) in enumerate(zip(self.body.documents, documents))]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)
        if self.body.top_n:
            results = results[: self.body.top_n]
        return {"id": self.id, "model": self.model, "usage": {"total_tokens": usage["prompt_tokens"]},
                "results": results}


async def create_scores(serving: Serving, body: ScoreRequest, request: Request) -> Response:
    serving.check_model(body.model)
    params = body.sampling_params()
    first, second = body.texts()
    inputs = [*((f"text_1[{i}]", t) for i, t in enumerate(first)), *((f"text_2[{i}]", t) for i, t in enumerate(second))]
    reqs = embedding_requests(serving, inputs, params)
    fmt = ScoreFormat(serving.model_name, [label for label, _ in inputs], len(first), request_id(request))
    return await serving.run(reqs, fmt, False, request)


async def create_rerank(serving: Serving, body: RerankRequest, request: Request) -> Response:
    serving.check_model(body.model)
    params = body.sampling_params()
    query, *documents = body.texts()
    reqs = embedding_requests(serving, [("query", query), *((f"documents[{i}]", d) for i, d in enumerate(documents))],
                              params)
    return await serving.run(reqs, RerankFormat(serving.model_name, body, request_id(request)), False, request)
