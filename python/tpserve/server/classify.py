"""vLLM's classification API (``POST /classify``, ``/v1/classify``) over a sequence classifier
(``*ForSequenceClassification``): each input's class probabilities, from its score head's logits at the last token
(softmax over the classes; sigmoid for one), and the most likely class's label (config.json's ``id2label``)."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from tpserve.pooling import class_probabilities
from tpserve.server.embeddings import PooledInputBody, check_task, hidden_states, pooled_requests
from tpserve.server.formats import Choice, ResponseFormat
from tpserve.server.request_id import request_id
from tpserve.server.serving import Serving


class ClassifyRequest(PooledInputBody):
    use_activation: bool = True  # vLLM's: False returns the raw logits as "probs"


def class_scores(raw: bytes, activation: bool) -> np.ndarray:
    """One input's answer: its class probabilities, or (``activation`` False) the logits."""
    return class_probabilities(raw) if activation else np.frombuffer(raw, dtype="<f4").astype(np.float32)


class ClassifyFormat(ResponseFormat):
    object_name = "list"
    id_prefix = "classify"

    def __init__(self, model: str, labels: tuple[str, ...], activation: bool, request_id: str | None = None) -> None:
        super().__init__(model, request_id=request_id)
        self.labels, self.activation = labels, activation

    def response(self, choices: Iterable[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        data = []
        for i, raw in enumerate(hidden_states(choices, [f"input[{i}]" for i in range(len(choices))], "classified")):
            probs = class_scores(raw, self.activation)
            data.append({"index": i, "label": self.labels[int(np.argmax(probs))], "probs": probs.tolist(),
                         "num_classes": len(probs)})
        tokens = usage["prompt_tokens"]
        return {"id": self.id, "object": "list", "created": self.created, "model": self.model, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}


async def create_classification(serving: Serving, body: ClassifyRequest, request: Request) -> Response:
    serving.check_model(body.model)
    check_task(serving, "classify")
    inputs = [(f"input[{i}]", item) for i, item in enumerate(body.inputs())]
    reqs = pooled_requests(serving, inputs, body.sampling_params("classify"), body.add_special_tokens)
    fmt = ClassifyFormat(serving.model_name, serving.head.labels, body.use_activation, request_id(request))
    return await serving.run(reqs, fmt, False, request)
