"""Sequence classifiers (transformers' ``*ForSequenceClassification``: a score head in place of the LM head):
``LLM.classify`` and ``LLM.score`` against transformers in float32, at TP 1 and 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from reference import hf_class_logits, hf_embedding, save_classifier

from tpserve import LLM
from tpserve.config import ModelConfig
from tpserve.pooling import class_scores

PROMPTS = ["a clockmaker", [5, 6, 7, 8], {"prompt_token_ids": list(range(3, 40))}]


@pytest.fixture(scope="module")
def classifier_dir(qwen3_dir, tmp_path_factory) -> str:
    return save_classifier(qwen3_dir, tmp_path_factory.mktemp("classifier"), ["negative", "neutral", "positive"])


@pytest.fixture(scope="module")
def cross_encoder_dir(qwen3_dir, tmp_path_factory) -> str:
    return save_classifier(qwen3_dir, tmp_path_factory.mktemp("cross_encoder"), ["relevant"])


def test_class_scores_apply_the_activation():
    raw = np.array([1.0, 2.0, 0.5], dtype="<f4").tobytes()
    expected = np.exp([1.0, 2.0, 0.5]) / np.exp([1.0, 2.0, 0.5]).sum()
    assert np.allclose(class_scores(raw, "softmax"), expected)
    assert np.allclose(class_scores(raw, "sigmoid"), 1 / (1 + np.exp(-np.array([1.0, 2.0, 0.5]))))
    assert class_scores(raw, "none").tolist() == [1.0, 2.0, 0.5]
    assert np.isfinite(class_scores(np.array([1e4, -1e4], "<f4").tobytes(), "softmax")).all()


IDENTITY = "torch.nn.modules.linear.Identity"


@pytest.mark.parametrize("keys, classes, classify, score", [
    ({}, 3, "softmax", "softmax"),
    ({}, 1, "sigmoid", "sigmoid"),
    ({"problem_type": "regression"}, 3, "none", "softmax"),  # /classify by problem_type, /score by the classes
    ({"problem_type": "multi_label_classification"}, 3, "sigmoid", "softmax"),
    ({"sentence_transformers": {"activation_fn": IDENTITY}}, 1, "sigmoid", "none"),  # /score by sentence-transformers
    ({"sbert_ce_default_activation_function": IDENTITY}, 1, "sigmoid", "none"),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}}, 3, "softmax", "sigmoid"),
])
def test_a_classifier_activations_follow_vllm_rules(keys, classes, classify, score, classifier_dir):
    """vLLM's two activations: /classify's by transformers' problem_type, a cross-encoder's /score's by
    sentence-transformers' function (else a sigmoid for one class, the softmax for more)."""
    config = json.loads(open(f"{classifier_dir}/config.json").read())
    config.pop("id2label"), config.pop("label2id")
    config.update(keys, num_labels=classes)
    classifier = ModelConfig.from_dict(config).classifier
    assert (classifier.classify_activation, classifier.score_activation) == (classify, score)
    tanh = {"sentence_transformers": {"activation_fn": "torch.nn.Tanh"}}
    with pytest.raises(ValueError, match="activation 'torch.nn.Tanh' is not served"):
        ModelConfig.from_dict(config | tanh)
    causal = config | tanh | {"architectures": ["Qwen3ForCausalLM"]}  # a key only classifiers read (review)
    assert ModelConfig.from_dict(causal).classifier is None


@pytest.mark.parametrize("keys, labels, two_way", [
    ({"classifier_from_token": ["a", "b"]}, ("b",), True),
    ({"classifier_from_token": ["a", "b"], "method": "no_post_processing"}, ("a", "b"), False),
    ({"classifier_from_token": ["a", "b", "c"]}, ("a", "b", "c"), False),
    ({"is_original_qwen3_reranker": True}, ("yes",), True),  # Qwen3-Reranker's: no, yes
])
def test_classifier_from_token_follows_vllm_methods(keys, labels, two_way, qwen3_dir):
    config = json.loads(open(f"{qwen3_dir}/config.json").read()) | {"architectures": ["Qwen3ForSequenceClassification"]}
    classifier = ModelConfig.from_dict(config | keys).classifier
    assert classifier.labels == labels and classifier.two_way == two_way
    assert classifier.joins_pairs and not ModelConfig.from_dict(config | keys | {"use_pad_token": True}).classifier.joins_pairs
    for bad, message in (({"classifier_from_token": ["a"], "method": "from_2_way_softmax"}, "takes two"),
                         ({"classifier_from_token": ["a"], "method": "mean"}, "method must be"),
                         ({"method": "from_2_way_softmax"}, "method needs classifier_from_token")):
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dict(config | bad)


def test_a_classifier_config_names_its_classes(classifier_dir):
    config = ModelConfig.from_pretrained(classifier_dir)
    assert config.architecture == "Qwen3ForSequenceClassification"
    assert config.labels == ("negative", "neutral", "positive")
    assert not config.lm_head and config.tie_word_embeddings  # no LM head of its own


@pytest.mark.parametrize("tp", [1, 2])
def test_llm_classify_matches_transformers(tp, classifier_dir):
    with LLM(classifier_dir, device="cpu", tp_size=tp, chunked_prefill_size=16) as llm:
        outputs = llm.classify(PROMPTS, use_tqdm=False)
        with pytest.raises(ValueError, match=r"\(Qwen3ForSequenceClassification\) has no LM head .*classification only"):
            llm.generate(["hi"], use_tqdm=False)
        with pytest.raises(ValueError, match=r"is a sequence classifier: it answers /classify, not embeddings"):
            llm.embed(["hi"], use_tqdm=False)
        logits = llm.classify(PROMPTS[1:2], use_tqdm=False, use_activation=False)[0].outputs.probs
    errors = []
    for out in outputs:
        expected = torch.softmax(hf_class_logits(classifier_dir, out.prompt_token_ids), dim=0)
        assert len(out.outputs.probs) == 3 and abs(sum(out.outputs.probs) - 1) < 1e-5
        errors.append(float((torch.tensor(out.outputs.probs) - expected).abs().max()))
    logit_error = float((torch.tensor(logits) - hf_class_logits(classifier_dir, PROMPTS[1])).abs().max())
    print(f"TP {tp}: class probability max abs error vs transformers: {max(errors):.2e}, logits {logit_error:.2e}")
    assert logit_error < 1e-5
    assert max(errors) < 1e-5 and [len(o.prompt_token_ids) for o in outputs][1:] == [4, 37]
    # the prompts' probabilities differ: the head sees each prompt's own last hidden state
    assert len({tuple(np.round(o.outputs.probs, 4)) for o in outputs}) == 3


def test_llm_score_with_a_cross_encoder_matches_transformers(cross_encoder_dir):
    with LLM(cross_encoder_dir, device="cpu") as llm:
        scores = llm.score("what is a clock", ["a clockmaker builds clocks", "the weather is fine"], use_tqdm=False)
        pairs = llm.score(["q one", "q two"], ["d one", "d two"], use_tqdm=False)
        tokenizer = llm.get_tokenizer()
        with pytest.raises(ValueError, match=r"data_1 must hold one text or as many as data_2 \(3\), got 2"):
            llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
        # truncation cuts the longer text of a pair first, as vLLM (transformers' longest_first): the query stays
        query, long_document = "what is a clock", " ".join(["tick tock"] * 40)
        cut = llm.score(query, long_document, use_tqdm=False, truncate_prompt_tokens=12)[0]
    for (a, b), out in zip([("what is a clock", "a clockmaker builds clocks"), ("what is a clock", "the weather is fine"),
                            ("q one", "d one"), ("q two", "d two")], scores + pairs):
        ids = tokenizer.encode(a, b)  # the pair as one prompt, as transformers' pair encoding makes it
        assert out.prompt_token_ids == ids
        expected = float(torch.sigmoid(hf_class_logits(cross_encoder_dir, ids)[0]))
        assert abs(out.outputs.score - expected) < 1e-5, (a, b)
    ids = tokenizer.encode(query, long_document, truncation="longest_first", max_length=12)
    assert cut.prompt_token_ids == ids and ids[:len(tokenizer.encode(query))] == tokenizer.encode(query)
    assert abs(cut.outputs.score - float(torch.sigmoid(hf_class_logits(cross_encoder_dir, ids)[0]))) < 1e-5


def test_llm_score_with_an_embedding_model_is_the_cosine(qwen3_dir, classifier_dir):
    with LLM(qwen3_dir, device="cpu") as llm:
        scores = llm.score("a query", ["doc one", "doc two"], use_tqdm=False)
        ids = {t: llm.get_tokenizer().encode(t) for t in ("a query", "doc one", "doc two")}
        with pytest.raises(ValueError, match=r"\(Qwen3ForCausalLM\) has no classification head"):
            llm.classify(["hi"], use_tqdm=False)
    for doc, out in zip(("doc one", "doc two"), scores):
        expected = float(hf_embedding(qwen3_dir, ids["a query"]) @ hf_embedding(qwen3_dir, ids[doc]))
        assert abs(out.outputs.score - expected) < 1e-5
    with LLM(classifier_dir, device="cpu") as llm, pytest.raises(ValueError, match="classifies into 3 classes"):
        llm.score("a", "b", use_tqdm=False)


def reranker_overrides(tokens: list[str]) -> dict:
    """vLLM's --hf-overrides for a causal LM served as a classifier of its LM head's rows of ``tokens``."""
    return {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens}


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
def test_a_causal_lm_served_as_a_reranker_from_two_tokens(tied, qwen3_dir, tiny_model_factory):
    """Qwen3-Reranker's scoring (the softmax of its "no" and "yes" logits at the last token, "yes") through
    classifier_from_token: LLM.score equals it from transformers' causal LM, at TP 1 and 2 (the LM head's rows are
    taken whole before the vocabulary is split). The pair is one text (query + document), as vLLM joins it for an
    LLM as reranker (whose template the client writes around both)."""
    from reference import hf_logits

    model_dir = tiny_model_factory("qwen3", tie_word_embeddings=True) if tied else qwen3_dir
    with LLM(model_dir, device="cpu") as llm:
        tokenizer = llm.get_tokenizer()
    no, yes = tokenizer.convert_ids_to_tokens([60, 61])
    query, documents = "where is the clockmaker", ["the clockmaker's shop", "tick tock"]
    for tp in (1, 2):
        with LLM(model_dir, device="cpu", tp_size=tp, hf_overrides=reranker_overrides([no, yes])) as llm:
            assert llm.model_config.labels == (yes,) and not llm.model_config.lm_head
            scores = llm.score(query, documents, use_tqdm=False)
        for document, out in zip(documents, scores):
            assert out.prompt_token_ids == tokenizer.encode(query + document)
            logits = hf_logits(model_dir, tokenizer.encode(query + document))[-1]
            expected = float(torch.softmax(logits[[60, 61]], dim=0)[1])
            assert abs(out.outputs.score - expected) < 1e-5, (tp, document)


def test_classifier_from_tokens_classifies_into_them(qwen3_dir):
    from reference import hf_logits

    with LLM(qwen3_dir, device="cpu") as llm:
        tokens = llm.get_tokenizer().convert_ids_to_tokens([70, 71, 72])
    with LLM(qwen3_dir, device="cpu", hf_overrides=reranker_overrides(tokens)) as llm:
        assert llm.model_config.labels == tuple(tokens)
        out = llm.classify([[5, 6, 7, 8]], use_tqdm=False)[0]
    expected = torch.softmax(hf_logits(qwen3_dir, [5, 6, 7, 8])[-1][[70, 71, 72]], dim=0)
    assert float((torch.tensor(out.outputs.probs) - expected).abs().max()) < 1e-5


@pytest.mark.parametrize("overrides, message", [
    ({"classifier_from_token": ["a", "b"]}, "architectures must be a \\*ForSequenceClassification"),
    (reranker_overrides(["no-such-token"]), "'no-such-token' is not a token of the model's tokenizer"),
    (reranker_overrides([]), "must be a non-empty list of tokens"),
    ('["a"]', "hf_overrides must be a JSON object"),
])
def test_bad_hf_overrides_are_clear_errors(overrides, message, qwen3_dir):
    with pytest.raises(ValueError, match=message):
        LLM(qwen3_dir, device="cpu", hf_overrides=overrides)
