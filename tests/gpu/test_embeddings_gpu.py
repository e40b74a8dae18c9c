"""Pooled requests on the GPU path (bf16, FlashInfer/Triton attention, the CUDA GEMV with the final norm fused at
one token, CUDA graphs for the decodes beside them): embeddings against transformers' base model in float32, a
classifier's probabilities against its *ForSequenceClassification, and a causal LM's classifier_from_token head
against its logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("flashinfer")

from reference import hf_class_logits, hf_embedding, hf_logits, save_classifier
from tpserve.engine.engine import Engine
from tpserve.engine_config import EngineConfig
from tpserve.sampling_params import SamplingParams
from tpserve.scheduler.scheduler import Scheduler


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3", num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=128,
                              intermediate_size=512, seed=3)


PROMPTS = {1: list(range(3, 60)), 2: [7], 3: [5, 6, 7, 8, 9]}


def pooled_answers(engine_config: EngineConfig, prompts: dict[int, list[int]], task: str) -> dict[int, np.ndarray]:
    """Each prompt's pooled answer; an embedding model's beside a decoding request (CUDA graphs; a classifier
    generates nothing)."""
    scheduler = Scheduler(Engine(engine_config))
    if task == "embed":
        scheduler.add_request(9, [9, 10, 11], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), seed=9)
        scheduler.step()
    for rid, prompt in prompts.items():
        scheduler.add_request(rid, prompt, SamplingParams(pooling=task), seed=rid)
    answers = {}
    while scheduler.has_work:
        for out in scheduler.step():
            if out.embedding is not None:
                answers[out.rid] = np.frombuffer(out.embedding, dtype="<f4").copy()
    return answers


@pytest.mark.parametrize("chunk", [8192, 16])
def test_embeddings_on_the_gpu_match_transformers(model_dir, chunk):
    from transformers import AutoModel

    answers = pooled_answers(EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", chunked_prefill_size=chunk,
                                          max_total_tokens=8192), PROMPTS, "embed")
    bf16 = AutoModel.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    worst, oracle = 0.0, 0.0  # 1 - cosine against float32: tpserve's, and transformers' own in bf16
    for rid, prompt in PROMPTS.items():
        expected = hf_embedding(model_dir, prompt)
        got = torch.nn.functional.normalize(torch.from_numpy(answers[rid]), dim=0)
        worst = max(worst, 1 - float(got @ expected))
        with torch.inference_mode():
            theirs = bf16(torch.tensor([prompt], device="cuda")).last_hidden_state[0, -1].float().cpu()
        oracle = max(oracle, 1 - float(torch.nn.functional.normalize(theirs, dim=0) @ expected))
    print(f"chunk {chunk}: worst 1 - cosine vs transformers float32: {worst:.2e} (transformers in bf16: {oracle:.2e})")
    assert worst <= 2 * oracle + 1e-4  # bf16's error, as transformers makes it in bf16


def test_classification_on_the_gpu_matches_transformers(model_dir, tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    classifier = save_classifier(model_dir, tmp_path_factory.mktemp("gpu_classifier"), ["a", "b", "c"])
    answers = pooled_answers(EngineConfig(model=classifier, device="cuda", dtype="bfloat16", chunked_prefill_size=16,
                                          max_total_tokens=8192), PROMPTS, "classify")
    bf16 = AutoModelForSequenceClassification.from_pretrained(classifier, dtype=torch.bfloat16).cuda().eval()
    worst, oracle = 0.0, 0.0  # max abs probability error against float32: tpserve's, transformers' own in bf16
    for rid, prompt in PROMPTS.items():
        expected = torch.softmax(hf_class_logits(classifier, prompt), 0)
        worst = max(worst, float((torch.softmax(torch.from_numpy(answers[rid]), 0) - expected).abs().max()))
        with torch.inference_mode():
            theirs = torch.softmax(bf16(torch.tensor([prompt], device="cuda")).logits[0].float().cpu(), 0)
        oracle = max(oracle, float((theirs - expected).abs().max()))
    print(f"classifier: worst probability error vs transformers float32: {worst:.2e} (transformers in bf16: {oracle:.2e})")
    assert worst <= 2 * oracle + 1e-3


def test_a_reranker_from_two_tokens_on_the_gpu_matches_transformers(model_dir):
    from transformers import AutoModelForCausalLM

    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["a", "b"]}
    config = EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", max_total_tokens=8192,
                          hf_overrides=json.dumps(overrides))
    ids = config.load_model_config().classifier.token_ids
    answers = pooled_answers(config, PROMPTS, "classify")
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    worst, oracle = 0.0, 0.0
    for rid, prompt in PROMPTS.items():
        expected = float(torch.softmax(hf_logits(model_dir, prompt)[-1][list(ids)], 0)[1])
        worst = max(worst, abs(float(torch.sigmoid(torch.tensor(answers[rid][0]))) - expected))
        with torch.inference_mode():
            logits = bf16(torch.tensor([prompt], device="cuda")).logits[0, -1].float().cpu()
        oracle = max(oracle, abs(float(torch.softmax(logits[list(ids)], 0)[1]) - expected))
    print(f"reranker from tokens: worst score error vs transformers float32: {worst:.2e} (bf16: {oracle:.2e})")
    assert worst <= 2 * oracle + 1e-3
