"""vLLM's classification API (``POST /classify``, ``/v1/classify``) over a sequence classifier
(``*ForSequenceClassification``): each input's class probabilities, from its score head's logits at the last token
(the model's activation: softmax over the classes, a sigmoid each, or none), and the most likely class's label
(config.json's ``id2label``)."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from tpserve.pooling import class_scores
from tpserve.server.embeddings import PooledInputBody, check_task, hidden_states, pooled_requests
from tpserve.server.formats import Choice, ResponseFormat
from tpserve.server.protocol import _Body
from tpserve.server.request_id import request_id
from tpserve.server.serving import Serving


class ActivationField(_Body):
    """vLLM's switch between a classifier's probabilities and its raw logits: ``use_activation``, or the names it
    still takes for it, ``activation`` and ``softmax``."""

    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None

    def class_activation(self, model_activation: str) -> str:
        """The activation to apply: the model's, or none where the request turned it off."""
        on = next((v for v in (self.use_activation, self.activation, self.softmax) if v is not None), True)
        return model_activation if on else "none"


class ClassifyRequest(PooledInputBody, ActivationField):
    pass


class ClassifyFormat(ResponseFormat):
    object_name = "list"
    id_prefix = "classify"

    def __init__(self, model: str, classes: tuple[str, ...], activation: str, inputs: list[str],
                 request_id: str | None = None) -> None:
        """``classes``: the model's class names; ``inputs``: the inputs' labels (``input[0]``, ...)."""
        super().__init__(model, request_id=request_id)
        self.classes, self.activation, self.inputs = classes, activation, inputs

    def response(self, choices: Iterable[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        data = []
        for i, raw in enumerate(hidden_states(choices, self.inputs, "classified")):
            probs = class_scores(raw, self.activation)
            data.append({"index": i, "label": self.classes[int(np.argmax(probs))], "probs": probs.tolist(),
                         "num_classes": len(probs)})
        tokens = usage["prompt_tokens"]
        return {"id": self.id, "object": "list", "created": self.created, "model": self.model, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}


async def create_classification(serving: Serving, body: ClassifyRequest, request: Request) -> Response:
    serving.check_model(body.model)
    check_task(serving, "classify")
    inputs = body.inputs(serving.trust_request_chat_template)
    reqs = pooled_requests(serving, inputs, body.sampling_params("classify"), body.add_special_tokens)
    activation = body.class_activation(serving.head.classify_activation)
    fmt = ClassifyFormat(serving.model_name, serving.head.labels, activation, [label for label, _ in inputs],
                         request_id(request))
    return await serving.run(reqs, fmt, False, request)
