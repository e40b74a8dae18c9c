"""The classify API and a cross-encoder's score and rerank over the stub backend: request and response shapes,
and which model kind answers which API (a classifier does not embed, an embedding model does not classify)."""

from __future__ import annotations

import math

import pytest
from stub_frontend import StubFrontend, stub_logits
from test_api_unit import MODEL, assert_error, make_client

from tpserve.pooling import ModelHead

CLASSIFIER = ModelHead(16, ("negative", "neutral", "positive"), "Qwen3ForSequenceClassification")
CROSS_ENCODER = ModelHead(16, ("relevant",), "Qwen3ForSequenceClassification")


def softmax(logits: list[float]) -> list[float]:
    exp = [math.exp(x - max(logits)) for x in logits]
    return [e / sum(exp) for e in exp]


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_classify_answers_each_input_with_its_class_probabilities():
    c, stub = make_client(head=CLASSIFIER)
    for path in ("/classify", "/v1/classify"):
        body = c.post(path, json={"model": MODEL, "input": ["good", "bad"]}).json()
        first, second = stub.submitted[-2:]
        assert [r.text for r in (first, second)] == ["good", "bad"] and first.params.pooling == "classify"
        assert first.prompt_param == "input" and body["object"] == "list" and body["id"].startswith("classify-")
        assert body["usage"] == {"prompt_tokens": 10, "total_tokens": 10, "completion_tokens": 0,
                                 "prompt_tokens_details": None}
        for row, req in zip(body["data"], (first, second)):
            expected = softmax(stub_logits(req.rid, 3))
            assert row["probs"] == pytest.approx(expected, abs=1e-6) and row["num_classes"] == 3
            assert row["label"] == CLASSIFIER.labels[req.rid % 3]  # the most likely class's name
        assert [row["index"] for row in body["data"]] == [0, 1]
    raw = c.post("/classify", json={"input": [5, 6, 7], "use_activation": False}).json()["data"][0]
    assert stub.submitted[-1].input_ids == [5, 6, 7]
    assert raw["probs"] == pytest.approx(stub_logits(stub.submitted[-1].rid, 3))  # the logits themselves


@pytest.mark.parametrize("body, param, message", [
    ({"input": ""}, "input", "must not hold an empty string"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "must be >= 1 or -1"),
    ({"input": "x", "priority": 1}, "priority", "priority scheduling is not enabled"),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
])
def test_classify_bad_requests_are_400s(body, param, message):
    c, _ = make_client(head=CLASSIFIER)
    assert_error(c.post("/classify", json=body), 400 if param != "model" else 404, message, param)


def test_each_api_is_answered_only_by_the_model_kind_that_serves_it():
    c, stub = make_client()  # a generative (or embedding) model
    assert_error(c.post("/classify", json={"input": "x"}), 400, "has no classification head", "model")
    c, stub = make_client(head=CLASSIFIER)
    assert_error(c.post("/v1/embeddings", json={"input": "x"}), 400, "is a sequence classifier", "model")
    assert_error(c.post("/v1/score", json={"text_1": "q", "text_2": "d"}), 400, "classifies into 3 classes", "model")
    assert_error(c.post("/v1/rerank", json={"query": "q", "documents": ["d"]}), 400, "classifies into 3 classes")
    assert not stub.submitted  # refused before anything reached the backend


def test_embedding_dimensions_past_the_hidden_size_are_refused_before_any_work():
    c, stub = make_client(head=ModelHead(hidden_size=4))
    assert_error(c.post("/v1/embeddings", json={"input": "x", "dimensions": 5}), 400, "[1, 4]", "dimensions")
    assert not stub.submitted
    assert len(c.post("/v1/embeddings", json={"input": "x", "dimensions": 4}).json()["data"][0]["embedding"]) == 4


def test_a_cross_encoder_scores_each_pair_as_one_prompt():
    c, stub = make_client(head=CROSS_ENCODER, stub=StubFrontend(classes=1))
    body = c.post("/v1/score", json={"text_1": "q", "text_2": ["a", "b"]}).json()
    reqs = stub.submitted[-2:]
    assert [(r.text, r.text_pair) for r in reqs] == [("q", "a"), ("q", "b")]
    assert all(r.params.pooling == "classify" and r.prompt_param == "text_2" for r in reqs)
    assert [d["score"] for d in body["data"]] == pytest.approx([sigmoid(stub_logits(r.rid, 1)[0]) for r in reqs])
    assert body["usage"] == {"prompt_tokens": 10, "total_tokens": 10, "completion_tokens": 0,
                             "prompt_tokens_details": None}  # vLLM's UsageInfo
    body = c.post("/score", json={"text_1": ["x", "y"], "text_2": ["z", "w"], "use_activation": False}).json()
    reqs = stub.submitted[-2:]
    assert [(r.text, r.text_pair) for r in reqs] == [("x", "z"), ("y", "w")]
    assert [d["score"] for d in body["data"]] == pytest.approx([stub_logits(r.rid, 1)[0] for r in reqs])  # raw logits

    body = c.post("/v1/rerank", json={"query": "q", "documents": ["a", "b", "c"], "top_n": 2}).json()
    reqs = stub.submitted[-3:]
    assert [(r.text, r.text_pair) for r in reqs] == [("q", "a"), ("q", "b"), ("q", "c")]
    scores = [sigmoid(stub_logits(r.rid, 1)[0]) for r in reqs]
    best = sorted(range(3), key=lambda i: scores[i], reverse=True)[:2]
    assert [r["index"] for r in body["results"]] == best
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([scores[i] for i in best])
    assert body["usage"] == {"prompt_tokens": 15, "total_tokens": 15}  # every pair's prompt, top_n or not (vLLM's)


def test_the_activation_is_the_models_unless_the_request_turns_it_off():
    c, stub = make_client(head=ModelHead(16, ("a", "b", "c"), "X", classify_activation="sigmoid"))  # a multi-label model
    row = c.post("/classify", json={"input": "x"}).json()["data"][0]
    assert row["probs"] == pytest.approx([sigmoid(v) for v in stub_logits(stub.submitted[-1].rid, 3)])
    for off in ({"use_activation": False}, {"activation": False}, {"softmax": False}):  # vLLM's names, old and new
        row = c.post("/classify", json={"input": "x", **off}).json()["data"][0]
        assert row["probs"] == pytest.approx(stub_logits(stub.submitted[-1].rid, 3)), off


def test_a_cross_encoder_query_is_not_tokenized_past_a_few_prompts_worth():
    """A cross-encoder tokenizes the query once per document: the query's characters times its documents may come to
    4 prompts' worth (review: a 4 KB body made the tokenizers read 262,144 characters), while many ordinary documents
    pass (review: 50 of 406 characters were refused by a cap on all the pairs); a text too long is named by its own
    field."""
    c, stub = make_client(head=CROSS_ENCODER, stub=StubFrontend(classes=1))
    limit = 128 * 32  # the test limits' characters of one prompt
    assert_error(c.post("/v1/rerank", json={"query": "q" * (limit + 1), "documents": ["d"]}), 400, "characters", "query")
    assert_error(c.post("/v1/score", json={"text_1": "q" * (limit + 1), "text_2": "d"}), 400, "characters", "text_1")
    body = {"query": "q" * (limit // 2), "documents": ["d"] * 9}
    assert_error(c.post("/v1/rerank", json=body), 400, "is tokenized again with each of the 9 texts", "query")
    assert not stub.submitted
    documents = ["d" * (limit // 8)] * 50  # 50 x 512 characters: 6 prompts' worth in all, each pair small
    assert c.post("/v1/rerank", json={"query": "q" * 100, "documents": documents}).status_code == 200


def test_an_llm_as_reranker_scores_each_pair_as_one_text():
    """vLLM joins an LLM-as-reranker's pair (classifier_from_token) into one text, where a cross-encoder's is a pair."""
    c, stub = make_client(head=ModelHead(16, ("yes",), "X", score_activation="sigmoid", joins_pairs=True),
                          stub=StubFrontend(classes=1))
    c.post("/v1/rerank", json={"query": "q:", "documents": ["a", "b"]})
    assert [(r.text, r.text_pair) for r in stub.submitted[-2:]] == [("q:a", None), ("q:b", None)]


def test_a_conversation_is_pooled_as_one_chat_prompt():
    """vLLM's ``messages`` for embeddings and classify: one answer, for the prompt the chat template renders (no
    generation prompt unless asked)."""
    for path, head in (("/v1/embeddings", ModelHead()), ("/classify", CLASSIFIER)):
        c, stub = make_client(head=head)
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        body = c.post(path, json={"messages": messages}).json()
        req = stub.submitted[-1]
        assert len(body["data"]) == 1 and len(stub.submitted) == 1
        assert req.messages == messages and req.text is None and not req.add_generation_prompt
        c.post(path, json={"messages": messages[:1], "add_generation_prompt": True,
                           "chat_template_kwargs": {"enable_thinking": False}})
        assert stub.submitted[-1].add_generation_prompt and stub.submitted[-1].chat_template_kwargs
        assert_error(c.post(path, json={"input": "x", "messages": messages}), 400, "either input or messages", "input")
        assert_error(c.post(path, json={}), 400, "either input or messages", "input")
        assert_error(c.post(path, json={"messages": []}), 400, "must not be empty", "messages")
        assert_error(c.post(path, json={"messages": messages, "chat_template": "{{ 1 }}"}), 400,
                     "--trust-request-chat-template", "chat_template")
        assert_error(c.post(path, json={"messages": messages[:1], "continue_final_message": True}), 400,
                     "continue_final_message")
        assert_error(c.post(path, json={"messages": [{"role": "user", "content": "x" * 5000}]}), 400, "characters",
                     "messages")
