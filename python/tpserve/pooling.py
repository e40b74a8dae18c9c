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
# How a classifier's logits become its answer (vLLM's rules, ``classifier.ClassifierConfig``): the softmax over the
# classes, a sigmoid of each (multi-label classifiers, cross-encoders), or the logits as they are (regression)
CLASS_ACTIVATIONS = ("softmax", "sigmoid", "none")


def pooled_values(raw: bytes) -> np.ndarray:
    """A pooled answer (``TokenOutput.embedding``: little-endian float32 bytes) as a float32 array."""
    return np.frombuffer(raw, dtype="<f4").astype(np.float32)


def embedding_vector(raw: bytes, dimensions: int | None = None, normalize: bool = True) -> np.ndarray:
    """The vector of a pooled hidden state: its first ``dimensions`` values (None: all), then scaled to length 1
    where ``normalize``."""
    vector = pooled_values(raw)
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
    classify_activation: str = "softmax"  # a classifier's, for /classify (one of CLASS_ACTIVATIONS)
    score_activation: str = "sigmoid"  # a cross-encoder's, for /v1/score and /v1/rerank
    joins_pairs: bool = False  # a cross-encoder scores a pair as one text (an LLM as reranker), not a text pair

    @property
    def classifies(self) -> bool:
        return bool(self.labels)

    def unserved(self, task: str) -> str | None:
        """Why this model does not answer requests of ``task`` (a pooling task, or "score": pairs scored by
        /v1/score, /v1/rerank, ``LLM.score``), or None."""
        if task == "embed" and self.labels:
            serves = "/classify, /v1/score and /v1/rerank" if len(self.labels) == 1 else "/classify"
            return f"this model ({self.architecture}) is a sequence classifier: it answers {serves}, not embeddings"
        if task == "classify" and not self.labels:
            return (f"this model ({self.architecture}) has no classification head: /classify (LLM.classify) needs a "
                    "*ForSequenceClassification checkpoint")
        if task == "score" and len(self.labels) > 1:
            return (f"this model classifies into {len(self.labels)} classes; scoring pairs needs a cross-encoder with "
                    "one (its relevance logit): use /classify")
        return None


def class_scores(raw: bytes, activation: str) -> np.ndarray:
    """A classifier's answer from its logits: ``activation`` (one of CLASS_ACTIVATIONS) applied to them (a softmax of
    one logit, always 1, is taken as its sigmoid)."""
    logits = pooled_values(raw).astype(np.float64)
    if activation == "sigmoid" or activation == "softmax" and logits.size == 1:
        logits = 1.0 / (1.0 + np.exp(-logits))
    elif activation == "softmax":
        exp = np.exp(logits - logits.max())
        logits = exp / exp.sum()
    return logits.astype(np.float32)


def model_head(config: "ModelConfig") -> ModelHead:
    c = config.classifier
    if c is None:
        return ModelHead(config.hidden_size, (), config.architecture)
    return ModelHead(config.hidden_size, c.labels, config.architecture, c.classify_activation, c.score_activation,
                     c.joins_pairs)


def pair_texts(first: list[str], second: list[str], names: tuple[str, str]) -> list[tuple[int, int]]:
    """The (first, second) index pairs a score request names: one first text against each second, or pairs of two
    lists of one length (a ValueError naming the lists, ``names``, otherwise)."""
    if len(first) not in (1, len(second)):
        raise ValueError(f"{names[0]} must hold one text or as many as {names[1]} ({len(second)}), got {len(first)}")
    return [(0 if len(first) == 1 else i, i) for i in range(len(second))]


def task_problem(config: "ModelConfig", task: str | None, embedding_problem: str | None) -> str | None:
    """Why this model cannot answer a request of ``task`` (a pooling task, or None: generation), or None.
    ``embedding_problem``: ``unserved_pooling``'s answer for the model."""
    if task is None:
        if config.lm_head:
            return None
        serves = ("embeddings only (/v1/embeddings, /v1/score, /v1/rerank, LLM.embed)" if not config.labels else
                  "classification only (/classify, /v1/score, /v1/rerank, LLM.classify, LLM.score)"
                  if len(config.labels) == 1 else "classification only (/classify, LLM.classify)")
        return f"this checkpoint ({config.architecture}) has no LM head (lm_head.weight): it serves {serves}"
    problem = model_head(config).unserved(task)
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
