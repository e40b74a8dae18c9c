"""End to end: real servers (scheduler ranks, tokenizer, detokenizer; CPU) over sequence classifiers saved by
transformers: /classify at TP 2 and a cross-encoder's /v1/score and /v1/rerank at TP 1, against transformers in
float32, and the APIs such a model does not serve answered with 400s."""

from __future__ import annotations

import httpx
import pytest
import torch
from reference import hf_class_logits, save_classifier
from server_process import running_server

LABELS = ["negative", "neutral", "positive"]


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir):
    from tpserve.tokenizer.loader import load_tokenizer

    return load_tokenizer(qwen3_dir)


@pytest.fixture(scope="module")
def classifier(qwen3_dir, tmp_path_factory):
    model_dir = save_classifier(qwen3_dir, tmp_path_factory.mktemp("e2e_classifier"), LABELS)
    for srv in running_server(["--model", model_dir, "--device", "cpu", "--tp-size", "2", "--served-model-name", "cls"]):
        yield srv.url, model_dir


@pytest.fixture(scope="module")
def cross_encoder(qwen3_dir, tmp_path_factory):
    model_dir = save_classifier(qwen3_dir, tmp_path_factory.mktemp("e2e_cross_encoder"), ["relevant"])
    for srv in running_server(["--model", model_dir, "--device", "cpu", "--served-model-name", "rerank"]):
        yield srv.url, model_dir


def test_classify_matches_transformers_at_tp2(classifier, tokenizer):
    url, model_dir = classifier
    texts = ["the clockmaker's shop", "tick tock", "你好 world"]
    expected = [hf_class_logits(model_dir, tokenizer.encode(t)) for t in texts]
    body = httpx.post(f"{url}/classify", json={"model": "cls", "input": texts}, timeout=60).json()
    raw = httpx.post(f"{url}/v1/classify", json={"input": texts, "use_activation": False}, timeout=60).json()
    logit_error = max(float((torch.tensor(r["probs"]) - e).abs().max()) for r, e in zip(raw["data"], expected))
    print(f"TP 2 /classify: max logit error vs transformers {logit_error:.2e}")
    assert logit_error < 1e-4
    for row, logits in zip(body["data"], expected):
        assert row["probs"] == pytest.approx(torch.softmax(logits, 0).tolist(), abs=1e-5)
        assert row["label"] == LABELS[int(logits.argmax())] and row["num_classes"] == 3
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(t)) for t in texts)
    messages = [{"role": "user", "content": texts[0]}]  # vLLM's messages: the chat template's prompt, classified
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    chat = httpx.post(f"{url}/classify", json={"messages": messages, "add_generation_prompt": True}, timeout=60).json()
    assert chat["data"][0]["probs"] == pytest.approx(torch.softmax(hf_class_logits(model_dir, ids), 0).tolist(),
                                                     abs=1e-5)


def test_a_classifier_refuses_what_it_does_not_serve(classifier):
    url, _ = classifier
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert chat.status_code == 400 and "classification only" in chat.json()["error"]["message"]
    embed = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert embed.status_code == 400 and "is a sequence classifier" in embed.json()["error"]["message"]
    score = httpx.post(f"{url}/v1/score", json={"text_1": "a", "text_2": "b"}, timeout=60)
    assert score.status_code == 400 and "classifies into 3 classes" in score.json()["error"]["message"]
    assert httpx.post(f"{url}/classify", json={"input": "still serving"}, timeout=60).status_code == 200


def test_a_cross_encoder_scores_and_reranks_as_transformers(cross_encoder, tokenizer):
    url, model_dir = cross_encoder
    query, documents = "where is the clockmaker", ["the clockmaker's shop", "tick tock", "你好 world"]
    expected = [float(torch.sigmoid(hf_class_logits(model_dir, tokenizer.encode(query, d))[0])) for d in documents]
    scores = httpx.post(f"{url}/v1/score", json={"text_1": query, "text_2": documents}, timeout=60).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(expected, abs=1e-5)
    ranked = httpx.post(f"{url}/rerank", json={"query": query, "documents": documents, "top_n": 2}, timeout=60).json()
    assert [r["index"] for r in ranked["results"]] == sorted(range(3), key=lambda i: expected[i], reverse=True)[:2]
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(sorted(expected, reverse=True)[:2],
                                                                              abs=1e-5)
