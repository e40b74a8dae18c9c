"""A sequence classifier's config (``*ForSequenceClassification``, or a causal LM made one by vLLM's
``classifier_from_token``): its classes, how its logits become answers, how a pair is tokenized. Read by
``config.ModelConfig`` with vLLM's rules, so a checkpoint scores as vLLM scores it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# vLLM's ways of making a score head from LM-head rows (config.json's "method" beside classifier_from_token)
TWO_WAY = "from_2_way_softmax"  # two tokens (no, yes): one class, yes row minus no row (sigmoid = 2-way softmax)
EACH_TOKEN = "no_post_processing"  # one class per token, its row
# sentence-transformers' activations (sentence_transformers.activation_fn, sbert_ce_default_activation_function),
# by torch class name
_NAMED_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "none", "Softmax": "softmax"}


@dataclass(frozen=True)
class ClassifierConfig:
    labels: tuple[str, ...]  # the classes in id order (the score head's rows)
    classify_activation: str  # /classify's (pooling.CLASS_ACTIVATIONS): by problem_type, as vLLM's classify
    score_activation: str  # a cross-encoder's /v1/score's: sentence-transformers' function first, as vLLM's score
    from_tokens: tuple[str, ...] = ()  # classifier_from_token: the score head is the LM head's rows of these
    two_way: bool = False  # TWO_WAY: one class from the two tokens' rows
    joins_pairs: bool = False  # a pair is scored as one text (text_1 + text_2), not the tokenizer's pair encoding
    token_ids: tuple[int, ...] = ()  # from_tokens' ids (ModelConfig.from_pretrained reads the tokenizer)


def classifier_config(cfg: dict[str, Any], hf: Any) -> ClassifierConfig:
    """A classifier's config from config.json (``cfg``) as transformers read it (``hf``); a ValueError naming what
    cannot be served."""
    tokens, two_way = _from_tokens(cfg)
    if tokens:
        labels = tokens[1:] if two_way else tokens
    else:
        names = {int(i): str(name) for i, name in (hf.id2label or {}).items()}
        if sorted(names) != list(range(len(names))) or not names:
            raise ValueError(f"config.json: id2label must name classes 0..n-1 (n >= 1), got {hf.id2label!r}")
        labels = tuple(names[i] for i in range(len(names)))
    problem = getattr(hf, "problem_type", None)
    if problem == "regression":
        classify = "none"
    elif problem == "multi_label_classification" or len(labels) == 1:
        classify = "sigmoid"
    else:
        classify = "softmax"
    st = cfg.get("sentence_transformers")
    named = (st.get("activation_fn") if isinstance(st, dict) else None) or cfg.get("sbert_ce_default_activation_function")
    score = _named_activation(named) if named is not None else "sigmoid" if len(labels) == 1 else "softmax"
    # vLLM scores an LLM-as-reranker's pair as one text (its use_pad_token is off); a cross-encoder by pair encoding
    joins = not cfg.get("use_pad_token", not tokens)
    return ClassifierConfig(labels, classify, score, tokens, two_way, joins)


def _from_tokens(cfg: dict[str, Any]) -> tuple[tuple[str, ...], bool]:
    """classifier_from_token and whether they make one class (TWO_WAY), by vLLM's keys: "method", and
    Qwen3-Reranker's is_original_qwen3_reranker (two tokens, TWO_WAY)."""
    value, method = cfg.get("classifier_from_token"), cfg.get("method")
    if cfg.get("is_original_qwen3_reranker"):
        method = method or TWO_WAY
        value = ["no", "yes"] if value is None else value
    if value is None:
        if method is not None:
            raise ValueError("config.json: method needs classifier_from_token (the tokens whose LM-head rows score)")
        return (), False
    if not isinstance(value, list) or not value or not all(isinstance(t, str) and t for t in value):
        raise ValueError(f"config.json: classifier_from_token must be a non-empty list of tokens, got {value!r}")
    method = method or (TWO_WAY if len(value) == 2 else EACH_TOKEN)
    if method not in (TWO_WAY, EACH_TOKEN):
        raise ValueError(f"config.json: method must be {TWO_WAY} or {EACH_TOKEN}, got {method!r}")
    if method == TWO_WAY and len(value) != 2:
        raise ValueError(f"config.json: method {TWO_WAY} takes two classifier_from_token tokens (no, yes), got {value}")
    return tuple(value), method == TWO_WAY


def _named_activation(name: Any) -> str:
    activation = _NAMED_ACTIVATIONS.get(str(name).rpartition(".")[2])
    if activation is None:
        raise ValueError(f"config.json: the cross-encoder activation {name!r} is not served (served: "
                         f"{', '.join(_NAMED_ACTIVATIONS)})")
    return activation
