"""What a pooled request (``SamplingParams.pooling``) gets back (``TokenOutput.embedding``) and makes of it: an
embedding (/v1/embeddings, ``LLM.embed``: the last token's final hidden state, optionally cut (Matryoshka) and
L2-normalized), or a sequence classifier's class logits there (/classify, a cross-encoder's /v1/score), made
probabilities; which tasks a model serves."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tpserve.config import ModelConfig

NORM_EPS = 1e-12  # torch.nn.functional.normalize's: a zero vector stays zero


def embedding_vector(raw: bytes, dimensions: int | None = None, normalize: bool = True) -> np.ndarray:
    """The vector of a pooled hidden state (little-endian float32 bytes): its first ``dimensions`` values (None:
    all), then scaled to length 1 where ``normalize``."""
    vector = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if dimensions is not None:
        if not 1 <= dimensions <= vector.size:
            raise ValueError(f"dimensions must be in [1, {vector.size}] (this model's hidden size), got {dimensions}")
        vector = vector[:dimensions]
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), NORM_EPS)
    return vector


@dataclass(frozen=True)
class ModelHead:
    """What the API server must know of the model to answer pooled requests: its hidden size (an embedding's length)
    and, for a sequence classifier, its classes in id order (``ModelConfig.labels``; empty: it embeds)."""

    hidden_size: int | None = None  # None: not known (the server then checks ``dimensions`` on the answer)
    labels: tuple[str, ...] = ()
    architecture: str = "the model"

    @property
    def classifies(self) -> bool:
        return bool(self.labels)

    def unserved(self, task: str) -> str | None:
        """Why this model does not answer pooling requests of ``task``, or None."""
        if task == "embed" and self.labels:
            return (f"this model ({self.architecture}) is a sequence classifier: it answers /classify, /v1/score and "
                    "/v1/rerank (LLM.classify, LLM.score), not embeddings")
        if task == "classify" and not self.labels:
            return (f"this model ({self.architecture}) has no classification head: /classify (LLM.classify) needs a "
                    "*ForSequenceClassification checkpoint")
        return None


def class_probabilities(raw: bytes) -> np.ndarray:
    """A classifier's probabilities from its logits (little-endian float32 bytes): the softmax over its classes, or
    for one class the sigmoid of its logit (a cross-encoder's relevance score), as vLLM's classify activation."""
    logits = np.frombuffer(raw, dtype="<f4").astype(np.float64)
    if logits.size == 1:
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    exp = np.exp(logits - logits.max())
    return (exp / exp.sum()).astype(np.float32)


def task_problem(config: "ModelConfig", task: str | None, embedding_problem: str | None) -> str | None:
    """Why this model cannot answer a request of ``task`` (a pooling task, or None: generation), or None.
    ``embedding_problem``: ``unserved_pooling``'s answer for the model."""
    if task is None:
        if config.lm_head:
            return None
        serves = ("classification only (/classify, /v1/score, /v1/rerank, LLM.classify, LLM.score)" if config.labels
                  else "embeddings only (/v1/embeddings, /v1/score, /v1/rerank, LLM.embed)")
        return f"this checkpoint ({config.architecture}) has no LM head (lm_head.weight): it serves {serves}"
    problem = ModelHead(config.hidden_size, config.labels, config.architecture).unserved(task)
    if problem is None and task == "embed" and embedding_problem is not None:
        problem = f"this model's embeddings are not served: {embedding_problem}"
    return problem


def unserved_pooling(model_dir: str) -> str | None:
    """Why this model's embeddings are not the last token's hidden state, or None: its sentence-transformers modules
    (``modules.json``) pool otherwise (``1_Pooling/config.json``'s mode) or transform the pooled vector (a Dense
    layer), which tpserve does not do. Without ``modules.json`` last-token pooling is taken, as vLLM takes it for
    decoder models."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    try:
        with open(modules_path, encoding="utf-8") as f:
            modules = json.load(f)
        for module in modules:
            kind, path = module.get("type", ""), module.get("path", "")
            if kind.endswith(".Dense"):
                return f"its sentence-transformers modules project the pooled vector ({path}: Dense); tpserve does not"
            if kind.endswith(".Pooling"):
                with open(os.path.join(model_dir, path, "config.json"), encoding="utf-8") as f:
                    modes = _pooling_modes(json.load(f))
                if modes != ["lasttoken"]:
                    shown = " + ".join(modes) or "none"
                    return (f"its sentence-transformers pooling is {shown} ({path}/config.json); tpserve pools "
                            "the last token only")
    except (OSError, ValueError, AttributeError, TypeError, RecursionError) as e:
        return f"its sentence-transformers modules.json could not be read ({type(e).__name__}: {e})"
    return None


def _pooling_modes(config: dict) -> list[str]:
    """The modes a sentence-transformers Pooling config turns on, as its class reads it: ``pooling_mode`` alone, else
    the ``pooling_mode_*`` flags over its defaults (mean tokens on)."""
    if isinstance(config.get("pooling_mode"), str):
        return [config["pooling_mode"]]  # "lasttoken", "mean", "cls", ...
    flags = {"mean_tokens": True} | {key.removeprefix("pooling_mode_"): on for key, on in config.items()
                                     if key.startswith("pooling_mode_")}
    return [mode for mode, on in flags.items() if on is True]
